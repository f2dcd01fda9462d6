// mxmoe-lower-to-linalg, row-major weights (the portable form the ROCm targets compile): one generic per
// grouped matmul reads the routed expert's byte and scale with tensor.extract at ids[t, j] and decodes the
// nibble with integer ops inside the reduction, so work grows with tokens x top_k and no dequantized
// weight tensor exists. An op with no layout attribute is read as row-major.
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s

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

// CHECK: func.func private @[[MM]](%[[X:.+]]: tensor<?x64xbf16>, %[[IDS:.+]]: tensor<?x2xi32>, %[[W:.+]]: tensor<4x96x32xi8>, %[[S:.+]]: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]} ins(%[[X]], %[[IDS]] : tensor<?x64xbf16>, tensor<?x2xi32>) outs(%{{.+}} : tensor<?x2x96xf32>)
// CHECK: tensor.extract %[[W]][%{{.+}}, %{{.+}}, %{{.+}}] : tensor<4x96x32xi8>
// CHECK: tensor.extract %[[S]][%{{.+}}, %{{.+}}, %{{.+}}] : tensor<4x96x2xi8>
// CHECK: arith.bitcast %{{.+}} : i32 to f32
// CHECK: arith.truncf %{{.+}} : f32 to bf16
// No host loop in this form:
// CHECK-NOT: scf.for
