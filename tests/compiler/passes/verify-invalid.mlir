// mxmoe-verify rejects each malformed op with `FILE:LINE:COL: error: 'OP' op RULE`; every chunk below
// (split at `// -----`) holds one broken op, and the CHECK line above the op names the rule it breaks.
// Shapes: E=4 experts, k=2, H=64 (w13: 4x64x32 packed bytes, 4x64x2 scales).
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-verify 2>&1 | filecheck %s
// The parser alone accepts all of them (they are generic ops): only the pass rejects them.
// RUN: mxmoe-opt %s --split-input-file > /dev/null

// route: one operand only
func.func @f0(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op expects 1 operands, got 2
  %r:2 = "mxmoe.route"(%l, %l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>, tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: logits must be rank 2
func.func @f1(%l: tensor<?x2x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op logits must be a rank-2 float tensor, got tensor<?x2x4xbf16>
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x2x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: logits must be float
func.func @f2(%l: tensor<?x4xi32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op logits must be a rank-2 float tensor, got tensor<?x4xi32>
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xi32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: top_k = 0
func.func @f3(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op top_k=0 must be in 1..4
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 0 : i64} : (tensor<?x4xbf16>) -> (tensor<?x0xf32>, tensor<?x0xi32>)
  return
}

// -----

// route: top_k above the number of experts
func.func @f4(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op top_k=5 must be in 1..4
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 5 : i64} : (tensor<?x4xbf16>) -> (tensor<?x5xf32>, tensor<?x5xi32>)
  return
}

// -----

// route: the number of experts must be static
func.func @f5(%l: tensor<?x?xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op logits must have a static number of experts, got tensor<?x?xbf16>
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x?xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: unknown routing
func.func @f6(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op routing must be one of ('topk_softmax', 'softmax_topk', 'sigmoid_topk', 'topk_sigmoid'), got 'sigmoid'
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "sigmoid", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: missing attribute
func.func @f7(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op missing attribute 'renormalize'
  %r:2 = "mxmoe.route"(%l) {routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: top_k must be an integer
func.func @f8(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op attribute 'top_k' must be int, got 2.0
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2.0 : f32} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: renormalize must be a bool, not an integer
func.func @f9(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op attribute 'renormalize' must be bool, got 1
  %r:2 = "mxmoe.route"(%l) {renormalize = 1 : i64, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: an array is not a valid attribute
func.func @f10(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op attribute 'top_k' must be a bool, integer, float or string, got [2]
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = [2]} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: ids must be i32
func.func @f11(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op results must be f32 weights and i32 ids
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi64>)
  return
}

// -----

// route: results must have top_k columns
func.func @f12(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op results must be (T x 2 x f32, T x 2 x i32)
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (tensor<?x3xf32>, tensor<?x3xi32>)
  return
}

// -----

// route: two results
func.func @f13(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op expects 2 results, got 1
  %r = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> tensor<?x2xf32>
  return
}

// -----

// route: results must be tensors
func.func @f14(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op result #0 must be a ranked tensor, got f32
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x4xbf16>) -> (f32, i32)
  return
}

// -----

// route: static token counts must agree
func.func @f15(%l: tensor<5x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op operands and results disagree on the token count
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<5x4xbf16>) -> (tensor<6x2xf32>, tensor<6x2xi32>)
  return
}

// -----

// grouped_matmul: has_bias = true needs the bias operand
func.func @f16(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op expects 5 operands, got 4
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: has_bias = false takes no bias
func.func @f17(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>, %b: tensor<4x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op expects 4 operands, got 5
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s, %b) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: packed weights are i8
func.func @f18(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xf32>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op w and w_scale must be i8 (packed MXFP4 / e8m0), got f32 and i8
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xf32>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: one scale per 32 values
func.func @f19(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x4xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op w_scale must be 4 x 64 x 2 for w 4 x 64 x 32 (K=64 in blocks of 32)
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x4xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: K must be whole MXFP4 blocks
func.func @f20(%x: tensor<?x48xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x24xi8>, %s: tensor<4x64x1xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op w_scale must be 4 x 64 x 1 for w 4 x 64 x 24 (K=48 in blocks of 32)
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x48xbf16>, tensor<?x2xi32>, tensor<4x64x24xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: weights are static
func.func @f21(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<?x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op weights must have static shapes
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<?x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: x's K must match the weights
func.func @f22(%x: tensor<?x32xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op x must be T x 64 or T x k x 64 float, got tensor<?x32xbf16>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x32xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: ids are i32
func.func @f23(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi64>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op ids must be T x k x i32, got tensor<?x2xi64>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi64>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: per-slot x must have k slots
func.func @f24(%x: tensor<?x3x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op x tensor<?x3x64xbf16> and ids tensor<?x2xi32> disagree on k
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x3x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: bias is E x N
func.func @f25(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>, %b: tensor<4x32xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op bias must be 4 x 64 float, got tensor<4x32xbf16>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s, %b) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x32xbf16>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul: result is T x k x N
func.func @f26(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op result must be T x 2 x 64 x bf16, got tensor<?x2x32xbf16>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x32xbf16>
  return
}

// -----

// grouped_matmul: result keeps x's element type
func.func @f27(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op result must be T x 2 x 64 x bf16, got tensor<?x2x64xf32>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xf32>
  return
}

// -----

// grouped_matmul: static token counts must agree
func.func @f28(%x: tensor<3x64xbf16>, %ids: tensor<4x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op operands and results disagree on the token count
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<3x64xbf16>, tensor<4x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<4x2x64xbf16>
  return
}

// -----

// grouped_matmul: operands are ranked tensors
func.func @f29(%x: tensor<*xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op operand #0 must be a ranked tensor, got tensor<*xbf16>
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<*xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// glu: gate and up need an even last dim
func.func @f30(%h: tensor<?x2x63xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op last dim must be static and even (gate and up), got tensor<?x2x63xbf16>
  %a = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, interleaved = true, limit = 7.0 : f32} : (tensor<?x2x63xbf16>) -> tensor<?x2x31xbf16>
  return
}

// -----

// glu: unknown activation
func.func @f31(%h: tensor<?x2x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op activation must be one of ('swiglu_oai', 'silu', 'silu_clamped', 'gelu', 'gelu_tanh'), got 'relu'
  %a = "mxmoe.glu"(%h) {activation = "relu", alpha = 1.702 : f32, interleaved = true, limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return
}

// -----

// glu: missing alpha
func.func @f32(%h: tensor<?x2x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op missing attribute 'alpha'
  %a = "mxmoe.glu"(%h) {activation = "silu", interleaved = true, limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return
}

// -----

// glu: interleaved is a bool
func.func @f33(%h: tensor<?x2x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op attribute 'interleaved' must be bool, got 'yes'
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, interleaved = "yes", limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return
}

// -----

// glu: result halves the last dim
func.func @f34(%h: tensor<?x2x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op result must halve the last dim of tensor<?x2x64xbf16>, got tensor<?x2x64xbf16>
  %a = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, interleaved = true, limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x64xbf16>
  return
}

// -----

// glu: a float input
func.func @f35(%h: tensor<?x64xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.glu' op input must be a float tensor of rank >= 1, got tensor<?x64xi8>
  %a = "mxmoe.glu"(%h) {activation = "swiglu_oai", alpha = 1.702 : f32, interleaved = true, limit = 7.0 : f32} : (tensor<?x64xi8>) -> tensor<?x32xi8>
  return
}

// -----

// grouped_matmul_glu: N must be even
func.func @f36(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x63x32xi8>, %s: tensor<4x63x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_glu' op N=63 must be even (gate and up)
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w, %s) {activation = "silu", alpha = 1.0 : f32, has_bias = false, interleaved = false, limit = 7.0 : f32} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x63x32xi8>, tensor<4x63x2xi8>) -> tensor<?x2x31xbf16>
  return
}

// -----

// grouped_matmul_glu: result is T x k x N/2
func.func @f37(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_glu' op result must be T x 2 x 32 x bf16, got tensor<?x2x64xbf16>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w, %s) {activation = "silu", alpha = 1.0 : f32, has_bias = false, interleaved = false, limit = 7.0 : f32} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return
}

// -----

// grouped_matmul_glu: needs the glu attributes
func.func @f38(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_glu' op missing attribute 'activation'
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x32xbf16>
  return
}

// -----

// grouped_matmul_combine: routing weights are f32
func.func @f39(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>, %rw: tensor<?x2xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_combine' op weights must be T x k x f32 like ids, got tensor<?x2xbf16>
  %o = "mxmoe.grouped_matmul_combine"(%x, %ids, %w, %s, %rw) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<?x2xbf16>) -> tensor<?x64xbf16>
  return
}

// -----

// grouped_matmul_combine: the routing weights operand is required
func.func @f40(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_combine' op expects 5 operands, got 4
  %o = "mxmoe.grouped_matmul_combine"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x64xbf16>
  return
}

// -----

// grouped_matmul_combine: result is T x N
func.func @f41(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x64x32xi8>, %s: tensor<4x64x2xi8>, %rw: tensor<?x2xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_combine' op result must be T x 64 x bf16, got tensor<?x2x64xbf16>
  %o = "mxmoe.grouped_matmul_combine"(%x, %ids, %w, %s, %rw) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<?x2xf32>) -> tensor<?x2x64xbf16>
  return
}

// -----

// combine: y is T x k x H
func.func @f42(%y: tensor<?x64xbf16>, %rw: tensor<?x2xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.combine' op expects y T x k x H and weights T x k, got tensor<?x64xbf16> and tensor<?x2xf32>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  return
}

// -----

// combine: routing weights are f32
func.func @f43(%y: tensor<?x2x64xbf16>, %rw: tensor<?x2xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.combine' op expects float y and f32 weights, got tensor<?x2x64xbf16> and tensor<?x2xbf16>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x2x64xbf16>, tensor<?x2xbf16>) -> tensor<?x64xbf16>
  return
}

// -----

// combine: k must agree
func.func @f44(%y: tensor<?x2x64xbf16>, %rw: tensor<?x4xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.combine' op expects y T x k x H and weights T x k, got tensor<?x2x64xbf16> and tensor<?x4xf32>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x2x64xbf16>, tensor<?x4xf32>) -> tensor<?x64xbf16>
  return
}

// -----

// combine: result keeps y's element type
func.func @f45(%y: tensor<?x2x64xbf16>, %rw: tensor<?x2xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.combine' op result must be T x 64 x bf16, got tensor<?x64xf32>
  %o = "mxmoe.combine"(%y, %rw) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xf32>
  return
}

// -----

// combine: operand count
func.func @f46(%y: tensor<?x2x64xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.combine' op expects 2 operands, got 1
  %o = "mxmoe.combine"(%y) : (tensor<?x2x64xbf16>) -> tensor<?x64xbf16>
  return
}

// -----

// an mxmoe op the dialect does not define
func.func @f47(%l: tensor<?x4xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.frobnicate' op is not an op of the mxmoe dialect (known: mxmoe.combine, mxmoe.glu, mxmoe.grouped_matmul, mxmoe.grouped_matmul_combine, mxmoe.grouped_matmul_glu, mxmoe.map_experts, mxmoe.route, mxmoe.weight_rows)
  %r = "mxmoe.frobnicate"(%l) : (tensor<?x4xbf16>) -> tensor<?x4xbf16>
  return
}

// -----

// ops nested in regions are verified too
func.func @nested(%c: i1, %l: tensor<?x4xbf16>) {
  scf.if %c {
    // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op top_k=7 must be in 1..4
    %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "topk_softmax", top_k = 7 : i64} : (tensor<?x4xbf16>) -> (tensor<?x7xf32>, tensor<?x7xi32>)
  }
  return
}

// CHECK-NOT: func.func

// -----

func.func @map_experts_bad_map(%g: tensor<?x2xi64>, %m: tensor<8xi32>) -> tensor<?x2xi32> {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.map_experts' op map must be 16 x i32, got tensor<8xi32>
  %a = "mxmoe.map_experts"(%g, %m) {num_global = 16 : i64, has_map = true} : (tensor<?x2xi64>, tensor<8xi32>) -> tensor<?x2xi32>
  return %a : tensor<?x2xi32>
}

// -----

func.func @map_experts_float_ids(%g: tensor<?x2xf32>) -> tensor<?x2xi32> {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.map_experts' op ids must be T x k x i32 or i64, got tensor<?x2xf32>
  %a = "mxmoe.map_experts"(%g) {num_global = 16 : i64, has_map = false} : (tensor<?x2xf32>) -> tensor<?x2xi32>
  return %a : tensor<?x2xi32>
}

// -----

func.func @weight_rows_bad_result(%x: tensor<?x64xbf16>, %w: tensor<?x1xf32>) -> tensor<?x1x64xf32> {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.weight_rows' op result must be T x 1 x 64 x bf16, got tensor<?x1x64xf32>
  %r = "mxmoe.weight_rows"(%x, %w) : (tensor<?x64xbf16>, tensor<?x1xf32>) -> tensor<?x1x64xf32>
  return %r : tensor<?x1x64xf32>
}

// -----

// route: groups that do not divide the experts into groups of 2 or more
func.func @route_bad_groups(%l: tensor<?x8xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op n_group=8 must divide the 8 experts into groups of 2 or more
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "sigmoid_topk", top_k = 2 : i64, n_group = 8 : i64, topk_group = 2 : i64} : (tensor<?x8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: the chosen groups hold fewer experts than top_k
func.func @route_groups_too_few(%l: tensor<?x8xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op topk_group=1 must be in 1..4 and its groups hold top_k=3 experts
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "sigmoid_topk", top_k = 3 : i64, n_group = 4 : i64, topk_group = 1 : i64} : (tensor<?x8xf32>) -> (tensor<?x3xf32>, tensor<?x3xi32>)
  return
}

// -----

// route: has_score_bias without its operand
func.func @route_bias_missing(%l: tensor<?x8xf32>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op expects 2 operands, got 1
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "sigmoid_topk", top_k = 2 : i64, has_score_bias = true} : (tensor<?x8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return
}

// -----

// route: renormalize on a routing whose weights are not renormalised
func.func @route_renorm_topk_sigmoid(%l: tensor<?x8xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op renormalize applies to routing softmax_topk or sigmoid_topk, not 'topk_sigmoid'
  %r:2 = "mxmoe.route"(%l) {renormalize = true, routing = "topk_sigmoid", top_k = 1 : i64} : (tensor<?x8xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>)
  return
}

// -----

// route: an optional attribute of the wrong type
func.func @route_scaling_type(%l: tensor<?x8xbf16>) {
  // CHECK: verify-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op attribute 'scaling' must be float, got 'x'
  %r:2 = "mxmoe.route"(%l) {renormalize = false, routing = "softmax_topk", top_k = 1 : i64, scaling = "x"} : (tensor<?x8xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>)
  return
}
