// mxmoe-convert-torch-ops rejects bad routing arguments with the op's location: a non-constant group count, and
// what mxmoe-verify's route schema refuses (groups on a routing without them, a bias of the wrong shape).
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops 2>&1 | filecheck %s

func.func @groups_not_constant(%l: !torch.vtensor<[?,8],f32>, %g: !torch.int) -> !torch.vtensor<[?,2],si32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "sigmoid_topk"
  %false = torch.constant.bool false
  %none = torch.constant.none
  %one = torch.constant.int 1
  %scaling = torch.constant.float 1.0
  // CHECK: convert-torch-ops-routing-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: torch.mxmoe.route: argument 'n_group' must be a compile-time constant, got a block argument
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false, %none, %g, %one, %scaling) : (!torch.vtensor<[?,8],f32>, !torch.int, !torch.str, !torch.bool, !torch.none, !torch.int, !torch.int, !torch.float) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return %r#1 : !torch.vtensor<[?,2],si32>
}

// -----

func.func @groups_on_softmax(%l: !torch.vtensor<[?,8],f32>) -> !torch.vtensor<[?,2],si32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "softmax_topk"
  %false = torch.constant.bool false
  %none = torch.constant.none
  %four = torch.constant.int 4
  %two = torch.constant.int 2
  %scaling = torch.constant.float 1.0
  // CHECK: convert-torch-ops-routing-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op n_group/topk_group apply to routing 'sigmoid_topk', not 'softmax_topk'
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false, %none, %four, %two, %scaling) : (!torch.vtensor<[?,8],f32>, !torch.int, !torch.str, !torch.bool, !torch.none, !torch.int, !torch.int, !torch.float) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return %r#1 : !torch.vtensor<[?,2],si32>
}

// -----

func.func @bias_shape(%l: !torch.vtensor<[?,8],f32>, %bias: !torch.vtensor<[4],f32>) -> !torch.vtensor<[?,2],si32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "sigmoid_topk"
  %false = torch.constant.bool false
  %one = torch.constant.int 1
  %scaling = torch.constant.float 1.0
  // CHECK: convert-torch-ops-routing-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.route' op score_bias must be 8 x f32, got tensor<4xf32>
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %false, %bias, %one, %one, %scaling) : (!torch.vtensor<[?,8],f32>, !torch.int, !torch.str, !torch.bool, !torch.vtensor<[4],f32>, !torch.int, !torch.int, !torch.float) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  return %r#1 : !torch.vtensor<[?,2],si32>
}
