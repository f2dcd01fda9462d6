// mxmoe-fuse: grouped_matmul -> glu becomes grouped_matmul_glu; grouped_matmul -> combine becomes
// grouped_matmul_combine (routing weights appended as the last operand). A matmul with any other user,
// or with more than one user, is left alone.
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-fuse | filecheck %s
// The fused IR is still valid mxmoe:
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-fuse,mxmoe-verify > /dev/null

// Shapes: E=4, k=2, H=64, I=32. w13: 4 x 64 x 32 (+ 4 x 64 x 2 scales, 4 x 64 bias); w2: 4 x 64 x 16.

// The whole MoE body: both epilogues fuse, the fused glu feeds the second matmul.
// CHECK-LABEL: func.func @moe
// CHECK-SAME: (%[[X:[^:]*]]: tensor<?x64xbf16>, %[[L:[^:]*]]: tensor<?x4xbf16>, %[[W13:[^:]*]]: tensor<4x64x32xi8>, %[[S13:[^:]*]]: tensor<4x64x2xi8>, %[[B13:[^:]*]]: tensor<4x64xbf16>, %[[W2:[^:]*]]: tensor<4x64x16xi8>, %[[S2:[^:]*]]: tensor<4x64x1xi8>, %[[B2:[^:]*]]: tensor<4x64xbf16>)
// CHECK: %[[R:.*]]:2 = "mxmoe.route"(%[[L]])
// CHECK-NEXT: %[[G:.*]] = "mxmoe.grouped_matmul_glu"(%[[X]], %[[R]]#1, %[[W13]], %[[S13]], %[[B13]]) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, has_bias = true, interleaved = true, limit = 7.000000e+00 : f32} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
// CHECK-NEXT: %[[O:.*]] = "mxmoe.grouped_matmul_combine"(%[[G]], %[[R]]#1, %[[W2]], %[[S2]], %[[B2]], %[[R]]#0) {has_bias = true} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<4x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
// CHECK-NEXT: return %[[O]]
// CHECK-NOT: "mxmoe.glu"
// CHECK-NOT: "mxmoe.combine"
// CHECK-NOT: "mxmoe.grouped_matmul"(
func.func @moe(%x: tensor<?x64xbf16>, %logits: tensor<?x4xbf16>,
               %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>, %b13: tensor<4x64xbf16>,
               %w2: tensor<4x64x16xi8>, %s2: tensor<4x64x1xi8>, %b2: tensor<4x64xbf16>) -> tensor<?x64xbf16> {
  %w, %ids = "mxmoe.route"(%logits) {top_k = 2 : i64, routing = "topk_softmax", renormalize = false} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13, %b13) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x64xbf16>
  %a = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2, %b2) {has_bias = true} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<4x64xbf16>) -> tensor<?x2x64xbf16>
  %o = "mxmoe.combine"(%y, %w) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  return %o : tensor<?x64xbf16>
}

// -----

// Without biases: the fused ops take no bias operand, the combine weights still come last; the glu's own
// attributes (silu, not interleaved) move over; an mxmoe.* attribute of the matmul is carried along.
// CHECK-LABEL: func.func @no_bias
// CHECK-SAME: (%[[X:[^:]*]]: tensor<?x64xf32>, %[[IDS:[^:]*]]: tensor<?x2xi32>, %[[RW:[^:]*]]: tensor<?x2xf32>, %[[W13:[^:]*]]: tensor<4x64x32xi8>, %[[S13:[^:]*]]: tensor<4x64x2xi8>, %[[W2:[^:]*]]: tensor<4x64x16xi8>, %[[S2:[^:]*]]: tensor<4x64x1xi8>)
// CHECK: %[[G:.*]] = "mxmoe.grouped_matmul_glu"(%[[X]], %[[IDS]], %[[W13]], %[[S13]]) {activation = "silu", alpha = 1.000000e+00 : f32, has_bias = false, interleaved = false, limit = 0.000000e+00 : f32, mxmoe.layout = "mxfp4-rowmajor"} : {{.*}} -> tensor<?x2x32xf32>
// CHECK: "mxmoe.grouped_matmul_combine"(%[[G]], %[[IDS]], %[[W2]], %[[S2]], %[[RW]]) {has_bias = false} : (tensor<?x2x32xf32>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<?x2xf32>) -> tensor<?x64xf32>
func.func @no_bias(%x: tensor<?x64xf32>, %ids: tensor<?x2xi32>, %rw: tensor<?x2xf32>,
                   %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>,
                   %w2: tensor<4x64x16xi8>, %s2: tensor<4x64x1xi8>) -> tensor<?x64xf32> {
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xf32>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xf32>
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 0.0 : f32, interleaved = false} : (tensor<?x2x64xf32>) -> tensor<?x2x32xf32>
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xf32>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xf32>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x2x64xf32>, tensor<?x2xf32>) -> tensor<?x64xf32>
  return %o : tensor<?x64xf32>
}

// -----

// NEGATIVE: the matmul feeding the glu has a second user (it is also returned): fusing would compute it
// twice, so neither the glu nor the matmul is touched.
// CHECK-LABEL: func.func @glu_input_two_users
// CHECK: %[[H:.*]] = "mxmoe.grouped_matmul"(
// CHECK-NEXT: %[[A:.*]] = "mxmoe.glu"(%[[H]])
// CHECK-NEXT: return %[[A]], %[[H]]
// CHECK-NOT: grouped_matmul_glu
func.func @glu_input_two_users(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> (tensor<?x2x32xbf16>, tensor<?x2x64xbf16>) {
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a, %h : tensor<?x2x32xbf16>, tensor<?x2x64xbf16>
}

// -----

// NEGATIVE: two glu users of one matmul: not fused either.
// CHECK-LABEL: func.func @two_glus
// CHECK: %[[H:.*]] = "mxmoe.grouped_matmul"(
// CHECK-NEXT: "mxmoe.glu"(%[[H]]) {activation = "silu"
// CHECK-NEXT: "mxmoe.glu"(%[[H]]) {activation = "swiglu_oai"
// CHECK-NOT: grouped_matmul_glu
func.func @two_glus(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> (tensor<?x2x32xbf16>, tensor<?x2x32xbf16>) {
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  %b = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a, %b : tensor<?x2x32xbf16>, tensor<?x2x32xbf16>
}

// -----

// NEGATIVE: the matmul feeding combine has a second user (another combine with other weights).
// CHECK-LABEL: func.func @combine_input_two_users
// CHECK: %[[Y:.*]] = "mxmoe.grouped_matmul"(
// CHECK-NEXT: "mxmoe.combine"(%[[Y]], %{{.*}})
// CHECK-NEXT: "mxmoe.combine"(%[[Y]], %{{.*}})
// CHECK-NOT: grouped_matmul_combine
func.func @combine_input_two_users(%a: tensor<?x2x32xbf16>, %ids: tensor<?x2xi32>, %rw: tensor<?x2xf32>, %rw2: tensor<?x2xf32>, %w2: tensor<4x64x16xi8>, %s2: tensor<4x64x1xi8>) -> (tensor<?x64xbf16>, tensor<?x64xbf16>) {
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  %o2 = "mxmoe.combine"(%y, %rw2) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  return %o, %o2 : tensor<?x64xbf16>, tensor<?x64xbf16>
}

// -----

// NEGATIVE: nothing to fuse: a glu and a combine whose inputs are not matmuls, and a matmul whose only
// user is not an mxmoe epilogue.
// CHECK-LABEL: func.func @nothing_to_fuse
// CHECK: "mxmoe.glu"(%arg0)
// CHECK: "mxmoe.combine"(%arg0, %arg1)
// CHECK: %[[Y:.*]] = "mxmoe.grouped_matmul"(
// CHECK-NEXT: "foo.use"(%[[Y]])
// CHECK-NOT: grouped_matmul_
func.func @nothing_to_fuse(%h: tensor<?x2x64xbf16>, %rw: tensor<?x2xf32>, %a: tensor<?x2x32xbf16>, %ids: tensor<?x2xi32>, %w2: tensor<4x64x16xi8>, %s2: tensor<4x64x1xi8>) {
  %g = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  %c = "mxmoe.combine"(%h, %rw) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  "foo.use"(%y) : (tensor<?x2x64xbf16>) -> ()
  return
}
