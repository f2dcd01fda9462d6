// A fused op takes the location of the op it replaces last (the glu / combine), and keeps the matmul's
// mxmoe.* attributes: a later pass's diagnostic about it points at that line and sees those attributes.
// RUN: not mxmoe-opt %s --passes='mxmoe-fuse,mxmoe-assign-layout{triton-mxfp4-hopper}' 2>&1 | filecheck %s

func.func @f(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> tensor<?x2x32xbf16> {
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  // CHECK: fuse-location.mlir:[[# @LINE + 1]]:8: error: 'mxmoe.grouped_matmul_glu' op already has weight layout 'mxfp4-rowmajor', but the target needs 'triton-mxfp4-hopper'
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}
