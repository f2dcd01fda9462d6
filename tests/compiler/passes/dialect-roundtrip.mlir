// Printing and re-parsing every mxmoe op is stable, and mxmoe-verify accepts them and changes nothing.
// RUN: mxmoe-opt %s > %t.1.mlir
// RUN: mxmoe-opt %t.1.mlir > %t.2.mlir
// RUN: diff %t.1.mlir %t.2.mlir
// RUN: mxmoe-opt %s --passes=mxmoe-verify > %t.v.mlir
// RUN: diff %t.1.mlir %t.v.mlir
// RUN: filecheck %s < %t.2.mlir

// Shapes: E=4 experts, k=2, H=64, I=32. w13: E x 2I x H/2 (+ E x 2I x H/32 scales), w2: E x H x I/2.

// CHECK-LABEL: func.func @all_ops
// CHECK-SAME: (%[[X:.*]]: tensor<?x64xbf16>, %[[L:.*]]: tensor<?x4xbf16>, %[[W13:.*]]: tensor<4x64x32xi8>, %[[S13:.*]]: tensor<4x64x2xi8>, %[[B13:.*]]: tensor<4x64xbf16>, %[[W2:.*]]: tensor<4x64x16xi8>, %[[S2:.*]]: tensor<4x64x1xi8>)
func.func @all_ops(%x: tensor<?x64xbf16>, %logits: tensor<?x4xbf16>,
                   %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>, %b13: tensor<4x64xbf16>,
                   %w2: tensor<4x64x16xi8>, %s2: tensor<4x64x1xi8>)
    -> (tensor<?x64xbf16>, tensor<?x64xbf16>) {
  // CHECK: %[[R:.*]]:2 = "mxmoe.route"(%[[L]]) {renormalize = true, routing = "softmax_topk", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  %w, %ids = "mxmoe.route"(%logits) {top_k = 2 : i64, routing = "softmax_topk", renormalize = true} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  // CHECK: %[[H:.*]] = "mxmoe.grouped_matmul"(%[[X]], %[[R]]#1, %[[W13]], %[[S13]], %[[B13]]) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x64xbf16>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13, %b13) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x64xbf16>
  // CHECK: %[[A:.*]] = "mxmoe.glu"(%[[H]]) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, interleaved = true, limit = 7.000000e+00 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  %a = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  // No bias: 4 operands, has_bias = false.
  // CHECK: %[[Y:.*]] = "mxmoe.grouped_matmul"(%[[A]], %[[R]]#1, %[[W2]], %[[S2]]) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  // CHECK: %[[O1:.*]] = "mxmoe.combine"(%[[Y]], %[[R]]#0) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  %o1 = "mxmoe.combine"(%y, %w) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  // Fused forms, with an extra (discardable) attribute that must survive printing.
  // CHECK: %[[G:.*]] = "mxmoe.grouped_matmul_glu"(%[[X]], %[[R]]#1, %[[W13]], %[[S13]], %[[B13]]) {activation = "silu", alpha = 1.000000e+00 : f32, has_bias = true, interleaved = false, limit = 0.000000e+00 : f32, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  %g = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13, %b13) {has_bias = true, activation = "silu", alpha = 1.0 : f32, limit = 0.0 : f32, interleaved = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  // CHECK: %[[O2:.*]] = "mxmoe.grouped_matmul_combine"(%[[G]], %[[R]]#1, %[[W2]], %[[S2]], %[[R]]#0) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  %o2 = "mxmoe.grouped_matmul_combine"(%g, %ids, %w2, %s2, %w) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  // CHECK: return %[[O1]], %[[O2]]
  return %o1, %o2 : tensor<?x64xbf16>, tensor<?x64xbf16>
}

// A weight read from a parameter-backed global: the global, its load and the op all round-trip.
// CHECK: util.global private @w2 {mxmoe.layout = "mxfp4-rowmajor"} = #flow.parameter.named<"model"::"w2"> : tensor<4x64x16xi8>
util.global private @w2 {mxmoe.layout = "mxfp4-rowmajor"} = #flow.parameter.named<"model"::"w2"> : tensor<4x64x16xi8>
// CHECK-LABEL: func.func @global_weight
func.func @global_weight(%a: tensor<?x2x32xf32>, %ids: tensor<?x2xi32>, %s2: tensor<4x64x1xi8>) -> tensor<?x2x64xf32> {
  // CHECK: %[[GW:.*]] = util.global.load @w2 : tensor<4x64x16xi8>
  %w2 = util.global.load @w2 : tensor<4x64x16xi8>
  // CHECK: "mxmoe.grouped_matmul"(%{{.*}}, %{{.*}}, %[[GW]], %{{.*}}) {has_bias = false}
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xf32>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xf32>
  return %y : tensor<?x2x64xf32>
}
