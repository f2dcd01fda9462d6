// mxmoe-lower-to-linalg{ukernel=PATH} on weights in the cpu-mxfp4-rows16 layout (the cpu target's
// activations="mxint8"): the same three dispatches as the blocksplit form, calling the int8 form's C symbols:
// the MXINT8 quantizer (rows of int8 in natural order, and 2 f32 words per 32-value block: the scale and the
// offset correction) and the rows16 matmul. Every activation type takes it, f32 included (no rounding after).
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s
// activations=mxint16: each row as two int8 planes (hi, lo of a 15-bit element), twice the rows' bytes and words,
// and the two-plane symbols:
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o,activations=mxint16}' | filecheck %s --check-prefix=X2
// X2: call @mxmoe_mxint16_quantize_rows(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c64, %c1, %c2, %{{.+}}, %workgroup_id_x)
// X2: call @mxmoe_rows16x2_grouped_matvec({{(%[0-9]+, )+}}%arg9, %c96, %c64, %c0, %c0, %c128, %workgroup_id_x, %workgroup_id_y, %c0, %c0, %c0, %c2)
// X2: flow.dispatch @{{.+}} -> (tensor<?x128xi8>{%{{.+}}}, tensor<?x8xf32>{%{{.+}}})
// X2: flow.dispatch @{{.+}}(%{{.+}}#0, %{{.+}}#1, %{{.+}}) : (tensor<?x128xi8>{%{{.+}}}, tensor<?x8xf32>{%{{.+}}},
// No linalg form reads the layout: without the object the pass refuses it, by name.
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg' 2>&1 | filecheck %s --check-prefix=NOUK
// NOUK: error: 'mxmoe.grouped_matmul_combine' op weight layout 'cpu-mxfp4-rows16' (activations='mxint8' / 'mxint16' / 'bf16') is read by the cpu microkernel only: pass mxmoe-lower-to-linalg{ukernel=PATH}

util.global private @w2 {mxmoe.layout = "cpu-mxfp4-rows16", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w2"> : tensor<4x96x32xi8>
util.global private @w2_scale {mxmoe.layout = "cpu-mxfp4-rows16", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w2_scale"> : tensor<4x96x2xi8>

// CHECK: stream.executable private @[[GEXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_group]]
// CHECK: call @mxmoe_group_slots(
// CHECK: stream.executable private @[[QEXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_quantize]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: func.func private @mxmoe_mxint8_quantize_rows(memref<?xf32>, memref<?xi32>, memref<?xi32>, memref<?xi8>, memref<?xf32>, index, index, index, index, index) attributes {hal.import.static}
// rows of x [T, 2, 64] f32 (kind 2), one per slot (div 1):
// CHECK: call @mxmoe_mxint8_quantize_rows(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c64, %c1, %c2, %{{.+}}, %workgroup_id_x)
// CHECK: stream.executable private @[[EXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_ukernel]]
// CHECK: func.func private @mxmoe_rows16_grouped_matvec(memref<?xi8>, memref<?xf32>, memref<?xi8>, memref<?xi8>, memref<?xf32>, memref<?xi64>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index, index, index, index, index) attributes {hal.import.static}
// S, N 96, K 64, no bias (kind 0), no deinterleave, tiles of 128 (TILE_N_INT8), no epilogue (f32 out, kind 2):
// CHECK: call @mxmoe_rows16_grouped_matvec({{(%[0-9]+, )+}}%arg9, %c96, %c64, %c0, %c0, %c128, %workgroup_id_x, %workgroup_id_y, %c0, %c0, %c0, %c2)

// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_combine_
// CHECK-NOT: scf.for
// CHECK: %[[G:.+]]:3 = flow.dispatch @[[GEXE]]::@[[GEXE]]
// 64 = 2 blocks: [S, 64] i8 and [S, 4] f32 words
// CHECK: %[[Q:.+]]:2 = flow.dispatch @[[QEXE]]::@[[QEXE]][%[[NS:.+]]](%{{.+}}, %[[G]]#0, %[[G]]#2, %{{.+}}, %[[NS]]) : (tensor<?x64xf32>{%{{.+}}}, tensor<?xi32>{%[[NS]]}, tensor<2xi32>, index, index) -> (tensor<?x64xi8>{%[[NS]]}, tensor<?x4xf32>{%[[NS]]})
// CHECK: flow.dispatch @[[EXE]]::@[[EXE]][%[[NS]]](%[[Q]]#0, %[[Q]]#1, %{{.+}}) : (tensor<?x64xi8>{%[[NS]]}, tensor<?x4xf32>{%[[NS]]}, tensor<4x96x32xi8>, tensor<4x96x2xi8>, tensor<1xf32>, {{.+}}) -> tensor<?x96xf32>{%[[NS]]}
// The combine adds the f32 slot rows; an f32 layer rounds nothing:
// CHECK: linalg.generic
// CHECK-NOT: arith.truncf
// CHECK: return
func.func @rows16(%x: tensor<?x2x64xf32>, %ids: tensor<?x2xi32>, %wt: tensor<?x2xf32>) -> tensor<?x96xf32> {
  %w = util.global.load @w2 : tensor<4x96x32xi8>
  %s = util.global.load @w2_scale : tensor<4x96x2xi8>
  %y = "mxmoe.grouped_matmul_combine"(%x, %ids, %w, %s, %wt) {has_bias = false, mxmoe.layout = "cpu-mxfp4-rows16"} : (tensor<?x2x64xf32>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>, tensor<?x2xf32>) -> tensor<?x96xf32>
  return %y : tensor<?x96xf32>
}
