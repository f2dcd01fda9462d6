// mxmoe-assign-layout rejects IR whose weights are already in another layout than the target's.
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-assign-layout 2>&1 | filecheck %s
// The same IR is fine for the layout it already has (all but the malformed op in the last chunk):
// RUN: not mxmoe-opt %s --split-input-file --passes='mxmoe-assign-layout{triton-mxfp4-hopper}' 2> %t.err | filecheck %s --check-prefix=SAME
// RUN: filecheck %s --check-prefix=SAME-ERR < %t.err

// An op laid out for another target.
func.func @conflicting_op(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> tensor<?x2x64xbf16> {
  // CHECK: assign-layout-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op already has weight layout 'triton-mxfp4-hopper', but the target needs 'mxfp4-rowmajor'
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return %h : tensor<?x2x64xbf16>
}
// SAME-LABEL: func.func @conflicting_op
// SAME: "mxmoe.grouped_matmul"({{.*}}) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"}

// -----

// A weight global already stored in another layout (say, shared with an op laid out for another target):
// the error names the global and both layouts.
util.global private @w2 {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w2"> : tensor<4x64x16xi8>
func.func @conflicting_global(%a: tensor<?x2x32xbf16>, %ids: tensor<?x2xi32>, %s2: tensor<4x64x1xi8>) -> tensor<?x2x64xbf16> {
  %w2 = util.global.load @w2 : tensor<4x64x16xi8>
  // CHECK: assign-layout-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op weight global w2 is already stored in layout 'triton-mxfp4-hopper', but this op needs 'mxfp4-rowmajor'
  %y = "mxmoe.grouped_matmul"(%a, %ids, %w2, %s2) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>) -> tensor<?x2x64xbf16>
  return %y : tensor<?x2x64xbf16>
}
// SAME: util.global private @w2 {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "values"}
// SAME-LABEL: func.func @conflicting_global
// SAME: "mxmoe.grouped_matmul"({{.*}}) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"}

// -----

// A malformed matmul (no has_bias) gets the verifier's diagnostic rather than a crash.
func.func @malformed(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> tensor<?x2x64xbf16> {
  // CHECK: assign-layout-invalid.mlir:[[# @LINE + 2]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op missing attribute 'has_bias'
  // SAME-ERR: assign-layout-invalid.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: 'mxmoe.grouped_matmul' op missing attribute 'has_bias'
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  return %h : tensor<?x2x64xbf16>
}
// CHECK-NOT: func.func
// SAME-ERR-NOT: error

// An unregistered layout name is rejected before anything runs.
// RUN: not mxmoe-opt %s --passes='mxmoe-assign-layout{no-such-layout}' 2>&1 | filecheck %s --check-prefix=UNKNOWN
// UNKNOWN: error: mxmoe-assign-layout: unknown layout 'no-such-layout' (known: cpu-mxfp4-blocksplit, cpu-mxfp4-rows16, mxfp4-rowmajor, triton-mxfp4-hopper, triton-mxfp4-hopper-tiled)
