// mxmoe-convert-torch-ops rejects custom-op calls it cannot turn into valid mxmoe ops, with a diagnostic
// at the call: scalar arguments that are not compile-time constants, unknown mxmoe custom ops, wrong
// argument counts, tensor types without a builtin equivalent, and calls whose mxmoe op fails its verifier.
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops 2>&1 | filecheck %s

// top_k computed at run time (here: the token count).
func.func @dynamic_top_k(%l: !torch.vtensor<[?,4],f32>) {
  %int0 = torch.constant.int 0
  %k = torch.aten.size.int %l, %int0 : !torch.vtensor<[?,4],f32>, !torch.int -> !torch.int
  %routing = torch.constant.str "topk_softmax"
  %false = torch.constant.bool false
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.route: argument 'top_k' must be a compile-time constant, got the result of 'torch.aten.size.int'
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false) : (!torch.vtensor<[?,4],f32>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return
}

// -----

// A scalar that is a function argument.
func.func @argument_scalar(%l: !torch.vtensor<[?,4],f32>, %routing: !torch.str) {
  %k = torch.constant.int 2
  %false = torch.constant.bool false
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.route: argument 'routing' must be a compile-time constant, got a block argument
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false) : (!torch.vtensor<[?,4],f32>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return
}

// -----

// An op of the mxmoe torch library that the compiler does not know.
func.func @unknown_op(%l: !torch.vtensor<[?,4],f32>) {
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: unknown mxmoe custom op 'torch.mxmoe.frobnicate'
  %0 = torch.operator "torch.mxmoe.frobnicate"(%l) : (!torch.vtensor<[?,4],f32>) -> !torch.vtensor<[?,4],f32>
  return
}

// -----

// route takes (logits, top_k, routing, renormalize) and optionally (score_bias, n_group, topk_group, scaling).
func.func @missing_argument(%l: !torch.vtensor<[?,4],f32>) {
  %k = torch.constant.int 2
  %routing = torch.constant.str "topk_softmax"
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.route: expects 4 to 8 arguments, got 3
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing) : (!torch.vtensor<[?,4],f32>, !torch.int, !torch.str) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return
}

// -----

// The converted op is verified: top_k = 9 with 8 experts.
func.func @fails_verifier(%l: !torch.vtensor<[?,8],f32>) {
  %k = torch.constant.int 9
  %routing = torch.constant.str "topk_softmax"
  %false = torch.constant.bool false
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op top_k=9 must be in 1..8
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false) : (!torch.vtensor<[?,8],f32>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,9],f32>, !torch.vtensor<[?,9],si32>)
  return
}

// -----

// f64 has no place in the mxmoe ops (they take bf16/f16/f32 activations).
func.func @f64_logits(%l: !torch.vtensor<[?,4],f64>) {
  %k = torch.constant.int 2
  %routing = torch.constant.str "topk_softmax"
  %false = torch.constant.bool false
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.route: cannot map !torch.vtensor<[?,4],f64> to a builtin tensor type
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false) : (!torch.vtensor<[?,4],f64>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return
}

// -----

// glu's alpha must be a number.
func.func @string_alpha(%h: !torch.vtensor<[?,2,64],f32>) {
  %act = torch.constant.str "silu"
  %alpha = torch.constant.str "1.702"
  %limit = torch.constant.float 7.0
  %inter = torch.constant.bool true
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.glu: argument 'alpha' must be a number, got '1.702'
  %a = torch.operator "torch.mxmoe.glu"(%h, %act, %alpha, %limit, %inter) : (!torch.vtensor<[?,2,64],f32>, !torch.str, !torch.str, !torch.float, !torch.bool) -> !torch.vtensor<[?,2,32],f32>
  return
}

// -----

// Only the bias of a grouped matmul may be None; combine's weights may not.
func.func @none_tensor(%y: !torch.vtensor<[?,2,64],f32>) {
  %none = torch.constant.none
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.combine: argument #1 must be a tensor, got None
  %o = torch.operator "torch.mxmoe.combine"(%y, %none) : (!torch.vtensor<[?,2,64],f32>, !torch.none) -> !torch.vtensor<[?,64],f32>
  return
}

// -----

// A tensor whose sizes and dtype are unknown cannot become a builtin tensor.
func.func @unranked(%y: !torch.vtensor, %w: !torch.vtensor<[?,2],f32>) {
  // CHECK: convert-torch-ops-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.combine: argument #0 must be a value tensor with known sizes and dtype, got !torch.vtensor
  %o = torch.operator "torch.mxmoe.combine"(%y, %w) : (!torch.vtensor, !torch.vtensor<[?,2],f32>) -> !torch.vtensor<[?,64],f32>
  return
}
// Nothing was converted and printed.
// CHECK-NOT: mxmoe.
