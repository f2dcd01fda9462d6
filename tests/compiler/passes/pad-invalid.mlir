// RUN: not mxmoe-opt %s --passes='mxmoe-pad{64}' --split-input-file 2>&1 | filecheck %s

// Weights that are function arguments cannot be padded once at compile time: rejected.
// CHECK: error: {{.*}}needs padding, but its weights are not util.global values
func.func @weights_as_args(%x: tensor<?x96xbf16>, %ids: tensor<?x1xi32>, %w: tensor<2x32x48xi8>, %s: tensor<2x32x3xi8>) -> tensor<?x1x32xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x96xbf16>, tensor<?x1xi32>, tensor<2x32x48xi8>, tensor<2x32x3xi8>) -> tensor<?x1x32xbf16>
  return %y : tensor<?x1x32xbf16>
}

// -----

// A weight global that a non-mxmoe op reads too would see the padded shape: rejected.
// CHECK: error: weight global @sw needs padding but is also read by 'tensor.dim'
module {
  util.global private @sw = #flow.parameter.named<"model"::"sw"> : tensor<2x32x48xi8>
  util.global private @ss = #flow.parameter.named<"model"::"ss"> : tensor<2x32x3xi8>
  func.func @shared(%x: tensor<?x96xbf16>, %ids: tensor<?x1xi32>) -> (tensor<?x1x32xbf16>, index) {
    %w = util.global.load @sw : tensor<2x32x48xi8>
    %s = util.global.load @ss : tensor<2x32x3xi8>
    %c0 = arith.constant 0 : index
    %d = tensor.dim %w, %c0 : tensor<2x32x48xi8>
    %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x96xbf16>, tensor<?x1xi32>, tensor<2x32x48xi8>, tensor<2x32x3xi8>) -> tensor<?x1x32xbf16>
    return %y, %d : tensor<?x1x32xbf16>, index
  }
}
