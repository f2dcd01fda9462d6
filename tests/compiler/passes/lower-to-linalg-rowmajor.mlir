// mxmoe-lower-to-linalg, row-major weights (the ROCm targets; lowering/rocm_grouped.py): the slots are laid out in
// row blocks of 16 by expert (small integer generics, no weight traffic), the activation rows and each block's expert
// weights are gathered with iree_linalg_ext.gather (the packed bytes viewed as f4E2M1FN, the scales as f8E8M0FNU),
// an all-parallel generic decodes the weights and a contraction generic whose operands are block arguments multiplies
// them (the form IREE gives to MFMA); the result rows are read back by slot. An op with no layout attribute is read as
// row-major.
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s
// The integer decode (gfx942) and the MXFP8 activations of gfx950's scaled MFMA:
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{activations=bf16,decode=int}' | filecheck %s --check-prefix=INT
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{activations=mxfp8}' | filecheck %s --check-prefix=MXFP8
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{activations=fp4}' 2>&1 | filecheck %s --check-prefix=BADACT
// BADACT: error: pass 'mxmoe-lower-to-linalg': activations must be one of bf16, mxfp8, mxint8, mxint16, got 'fp4'

// CHECK-LABEL: func.func @plain(
// CHECK: %[[Y:.+]] = call @[[MM:mxmoe_grouped_matmul_[0-9a-f]+]](
// CHECK: return %[[Y]]
func.func @plain(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}

// The same op without a layout attribute is lowered row-major too (to a function of its own: the
// function key covers all attributes, since the layout picks the strategy).
// CHECK-LABEL: func.func @no_layout(
// CHECK: call @mxmoe_grouped_matmul_{{[0-9a-f]+}}(
func.func @no_layout(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}

// One expert (a shared expert):
// CHECK-LABEL: func.func @shared(
func.func @shared(%x: tensor<?x64xbf16>, %ids: tensor<?x1xi32>, %w: tensor<1x96x32xi8>, %s: tensor<1x96x2xi8>) -> tensor<?x1x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x1xi32>, tensor<1x96x32xi8>, tensor<1x96x2xi8>) -> tensor<?x1x96xbf16>
  return %y : tensor<?x1x96xbf16>
}

// CHECK: func.func private @[[MM]](%[[X:.+]]: tensor<?x64xbf16>, %[[IDS:.+]]: tensor<?x2xi32>, %[[W:.+]]: tensor<4x96x32xi8>, %[[S:.+]]: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
// The packed bytes viewed as f4E2M1FN, the scales as f8E8M0FNU:
// CHECK: %[[SL:.+]] = arith.muli %{{.+}}, %{{.+}} : index
// CHECK: %[[WF:.+]] = iree_tensor_ext.bitcast %{{.+}} : tensor<4x96x2x16xi8> -> tensor<4x96x2x32xf4E2M1FN>
// CHECK: %[[SF:.+]] = iree_tensor_ext.bitcast %[[S]] : tensor<4x96x2xi8> -> tensor<4x96x2xf8E8M0FNU>
// Blocks of 64 rows where the slots average 16 or more per expert (4 experts: 64 slots), else of 16 (a host-side
// scf.if on T); NB = m + (S - m) / rows with m = min(E, S), from T on the host (no read back):
// CHECK: %[[LARGE:.+]] = arith.cmpi uge, %[[SL]], %c64 : index
// CHECK: scf.if %[[LARGE]] -> (tensor<?x96xbf16>) {
// CHECK: arith.minui %[[SL]], %{{.+}} : index
// CHECK: iree_linalg_ext.gather dimension_map = [0] ins(%{{.+}}, %{{.+}} : tensor<?x2x32xbf16>, tensor<?x64xi32>) outs(%{{.+}} : tensor<?x64x2x32xbf16>)
// CHECK: } else {
// CHECK: arith.minui %[[SL]], %{{.+}} : index
// Slots per expert, then each expert's first and last block:
// CHECK: linalg.generic {{.+}}iterator_types = ["parallel", "reduction"]} ins(%{{.+}} : tensor<?xi32>) outs(%{{.+}} : tensor<4xi32>)
// CHECK: linalg.generic {{.+}}iterator_types = ["parallel", "reduction"]} ins(%{{.+}} : tensor<4xi32>) outs(%{{.+}}, %{{.+}} : tensor<4xi32>, tensor<4xi32>)
// CHECK: %[[GW:.+]] = iree_linalg_ext.gather dimension_map = [0] ins(%[[WF]], %[[BEXP:.+]] : tensor<4x96x2x32xf4E2M1FN>, tensor<?xi32>) outs(%{{.+}} : tensor<?x96x2x32xf4E2M1FN>)
// CHECK: %[[GS:.+]] = iree_linalg_ext.gather dimension_map = [0] ins(%[[SF]], %[[BEXP]] : tensor<4x96x2xf8E8M0FNU>, tensor<?xi32>) outs(%{{.+}} : tensor<?x96x2xf8E8M0FNU>)
// CHECK: %[[GX:.+]] = iree_linalg_ext.gather dimension_map = [0] ins(%{{.+}}, %{{.+}} : tensor<?x2x32xbf16>, tensor<?x16xi32>) outs(%{{.+}} : tensor<?x16x2x32xbf16>)
// CHECK: %[[WD:.+]] = linalg.generic {{.+}}iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins(%[[GW]], %[[GS]] : {{.+}}) outs(%{{.+}} : tensor<?x96x2x32xbf16>)
// CHECK: arith.scaling_extf %{{.+}}, %{{.+}} : f4E2M1FN, f8E8M0FNU to bf16
// CHECK: linalg.generic {{.+}}iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]} ins(%[[GX]], %[[WD]] : tensor<?x16x2x32xbf16>, tensor<?x96x2x32xbf16>) outs(%{{.+}} : tensor<?x16x96xf32>)
// CHECK-NEXT: ^bb0(%{{.+}}: bf16, %{{.+}}: bf16, %{{.+}}: f32):
// Read back by slot (0 for an invalid one), rounded to bf16 in the same generic:
// CHECK: tensor.extract %{{.+}}[%{{.+}}, %{{.+}}] : tensor<?x96xf32>
// CHECK: arith.truncf %{{.+}} : f32 to bf16
// No host loop, no weight byte read inside a reduction:
// CHECK-NOT: scf.for
// CHECK-NOT: tensor.extract %[[W]]

// INT: linalg.generic {{.+}}iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins(%{{.+}}, %{{.+}} : tensor<?x96x2x32xf4E2M1FN>, tensor<?x96x2xf8E8M0FNU>) outs(%{{.+}} : tensor<?x96x2x32xbf16>)
// INT-NOT: scaling_extf
// INT-NOT: math.
// INT: arith.bitcast %{{.+}} : f4E2M1FN to i4
// INT: arith.bitcast %{{.+}} : i16 to bf16
// INT: linalg.yield

// MXFP8: func.func private @mxmoe_grouped_matmul_
// The activations quantized per token (amax per 32, then e4m3 values), gathered with their scales:
// MXFP8: linalg.generic {{.+}}iterator_types = ["parallel", "parallel", "reduction"]} ins(%{{.+}} : tensor<?x2x32xbf16>) outs(%{{.+}} : tensor<?x2xf32>)
// MXFP8: arith.truncf %{{.+}} : f32 to f8E4M3FN
// MXFP8: iree_linalg_ext.gather dimension_map = [0] ins(%{{.+}}, %{{.+}} : tensor<?x2x32xf8E4M3FN>, tensor<?x16xi32>)
// MXFP8: iree_linalg_ext.gather dimension_map = [0] ins(%{{.+}}, %{{.+}} : tensor<?x2xf8E8M0FNU>, tensor<?x16xi32>)
// The weights' e2m1 codes re-encoded as e4m3 (exact), then the 4-input scaled contraction:
// MXFP8: arith.bitcast %{{.+}} : i8 to f8E4M3FN
// MXFP8: linalg.generic {{.+}}iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]} ins(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}} : tensor<?x16x2x32xf8E4M3FN>, tensor<?x96x2x32xf8E4M3FN>, tensor<?x16x2xf8E8M0FNU>, tensor<?x96x2xf8E8M0FNU>) outs(%{{.+}} : tensor<?x16x96xf32>)
// MXFP8: arith.scaling_extf %{{.+}}, %{{.+}} : f8E4M3FN, f8E8M0FNU to f32
// MXFP8: arith.scaling_extf %{{.+}}, %{{.+}} : f8E4M3FN, f8E8M0FNU to f32


// The one-expert function: no sort, the slots in order, every block on expert 0.
// CHECK: func.func private @mxmoe_grouped_matmul_{{[0-9a-f]+}}(%{{.+}}: tensor<?x64xbf16>, %{{.+}}: tensor<?x1xi32>, %{{.+}}: tensor<1x96x32xi8>
// CHECK-NOT: iterator_types = ["parallel", "reduction"]
// CHECK: iree_linalg_ext.gather
// CHECK: return
