// mxmoe-lower-to-linalg rejects a grouped matmul whose weights are in a layout it has no lowering for
// (here the Triton K-major layout), with a diagnostic at the op that names the supported layouts.
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-lower-to-linalg 2>&1 | filecheck %s

func.func @triton_layout(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16> {
  // CHECK: lower-to-linalg-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op weight layout 'triton-mxfp4-hopper' has no linalg lowering (supported: mxfp4-rowmajor, cpu-mxfp4-blocksplit, cpu-mxfp4-rows16)
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}

// -----

// The op must also be well formed: lowering verifies each op first (scales of the wrong shape).
func.func @bad_scales(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x3xi8>) -> tensor<?x2x96xbf16> {
  // CHECK: lower-to-linalg-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op w_scale must be 4 x 96 x 2 for w 4 x 96 x 32
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x3xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}
