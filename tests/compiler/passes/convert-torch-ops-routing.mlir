// mxmoe-convert-torch-ops on the routings of docs/routing.md: the optional arguments of torch.mxmoe.route
// (score_bias, n_group, topk_group, scaling) become an operand and attributes, written only where they differ from
// what their absence means; graphs exported before those arguments existed (4 arguments) still convert.
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops | filecheck %s
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops,mxmoe-verify > /dev/null

// DeepSeek-V3's routing: sigmoid scores, a correction bias, 4 groups of which 2 are chosen, scaling 2.5.
// CHECK-LABEL: func.func @sigmoid_topk
// CHECK: %[[LB:.*]] = torch_c.to_builtin_tensor %{{.*}} : !torch.vtensor<[?,8],f32> -> tensor<?x8xf32>
// CHECK: %[[BB:.*]] = torch_c.to_builtin_tensor %{{.*}} : !torch.vtensor<[8],f32> -> tensor<8xf32>
// CHECK: "mxmoe.route"(%[[LB]], %[[BB]]) {has_score_bias = true, n_group = 4 : i64, renormalize = true, routing = "sigmoid_topk", scaling = 2.500000e+00 : f32, top_k = 2 : i64, topk_group = 2 : i64} : (tensor<?x8xf32>, tensor<8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
func.func @sigmoid_topk(%l: !torch.vtensor<[?,8],f32>, %bias: !torch.vtensor<[8],f32>) -> !torch.vtensor<[?,2],si32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "sigmoid_topk"
  %true = torch.constant.bool true
  %groups = torch.constant.int 4
  %chosen = torch.constant.int 2
  %scaling = torch.constant.float 2.5
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %true, %bias, %groups, %chosen, %scaling) : (!torch.vtensor<[?,8],f32>, !torch.int, !torch.str, !torch.bool, !torch.vtensor<[8],f32>, !torch.int, !torch.int, !torch.float) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return %r#1 : !torch.vtensor<[?,2],si32>
}

// -----

// Llama-4's routing: the default optional arguments leave no attributes behind (the IR of the older routings).
// CHECK-LABEL: func.func @topk_sigmoid
// CHECK: "mxmoe.route"(%{{.*}}) {renormalize = false, routing = "topk_sigmoid", top_k = 1 : i64} : (tensor<?x8xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>)
func.func @topk_sigmoid(%l: !torch.vtensor<[?,8],bf16>) -> !torch.vtensor<[?,1],si32> {
  %k = torch.constant.int 1
  %routing = torch.constant.str "topk_sigmoid"
  %false = torch.constant.bool false
  %none = torch.constant.none
  %one = torch.constant.int 1
  %one_0 = torch.constant.int 1
  %scaling = torch.constant.float 1.0
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false, %none, %one, %one_0, %scaling) : (!torch.vtensor<[?,8],bf16>, !torch.int, !torch.str, !torch.bool, !torch.none, !torch.int, !torch.int, !torch.float) -> (!torch.vtensor<[?,1],f32>, !torch.vtensor<[?,1],si32>)
  return %r#1 : !torch.vtensor<[?,1],si32>
}

// -----

// A scaling factor alone (an integer becomes an f32 attribute), on softmax_topk.
// CHECK-LABEL: func.func @scaled_softmax
// CHECK: "mxmoe.route"(%{{.*}}) {renormalize = false, routing = "softmax_topk", scaling = 2.000000e+00 : f32, top_k = 2 : i64}
func.func @scaled_softmax(%l: !torch.vtensor<[?,8],bf16>) -> !torch.vtensor<[?,2],si32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "softmax_topk"
  %false = torch.constant.bool false
  %none = torch.constant.none
  %one = torch.constant.int 1
  %two = torch.constant.int 2
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false, %none, %one, %one, %two) : (!torch.vtensor<[?,8],bf16>, !torch.int, !torch.str, !torch.bool, !torch.none, !torch.int, !torch.int, !torch.int) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return %r#1 : !torch.vtensor<[?,2],si32>
}
