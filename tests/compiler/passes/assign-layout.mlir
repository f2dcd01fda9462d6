// mxmoe-assign-layout{LAYOUT}: every grouped matmul form gets mxmoe.layout = LAYOUT, and so does each weight
// global it reads, with mxmoe.weight_role (values / scales / bias). Other ops and globals are not touched.
// RUN: mxmoe-opt %s --passes=mxmoe-assign-layout | filecheck %s --check-prefixes=CHECK,ROW
// RUN: mxmoe-opt %s --passes='mxmoe-assign-layout{triton-mxfp4-hopper}' | filecheck %s --check-prefixes=CHECK,HOPPER
// Running it twice with the same layout is a no-op the second time:
// RUN: mxmoe-opt %s --passes=mxmoe-assign-layout > %t.once.mlir
// RUN: mxmoe-opt %t.once.mlir --passes=mxmoe-assign-layout > %t.twice.mlir
// RUN: diff %t.once.mlir %t.twice.mlir
// A layout per activation element type (the cpu target on AMX hosts: bf16 layers rows16, the others blocksplit);
// these ops read bf16 activations:
// RUN: mxmoe-opt %s --passes='mxmoe-assign-layout{cpu-mxfp4-blocksplit,bf16=cpu-mxfp4-rows16}' | filecheck %s --check-prefix=BYTYPE
// RUN: mxmoe-opt %s --passes='mxmoe-assign-layout{cpu-mxfp4-blocksplit,f16=cpu-mxfp4-rows16}' | filecheck %s --check-prefix=OTHERTYPE
// BYTYPE: util.global private @w13 {mxmoe.layout = "cpu-mxfp4-rows16", mxmoe.weight_role = "values"}
// BYTYPE: "mxmoe.grouped_matmul_glu"({{.*}}mxmoe.layout = "cpu-mxfp4-rows16"}
// OTHERTYPE: util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"}
// A malformed or unknown option item is refused, by name:
// RUN: not mxmoe-opt %s --passes='mxmoe-assign-layout{cpu-mxfp4-blocksplit,bf16}' 2>&1 | filecheck %s --check-prefix=BADITEM
// BADITEM: mxmoe-assign-layout: bad option item 'bf16' (expected ELEM=LAYOUT)
// RUN: not mxmoe-opt %s --passes='mxmoe-assign-layout{cpu-mxfp4-blocksplit,bf16=rows16}' 2>&1 | filecheck %s --check-prefix=BADLAYOUT
// BADLAYOUT: mxmoe-assign-layout: unknown layout 'rows16'
// NEGATIVE (more in assign-layout-invalid.mlir): IR laid out for one target is rejected by another target's layout, with a diagnostic:
// RUN: not mxmoe-opt %t.once.mlir --passes='mxmoe-assign-layout{triton-mxfp4-hopper}' 2>&1 | filecheck %s --check-prefix=RELAYOUT

// CHECK-LABEL: util.global private @router_weight
// CHECK-NOT: mxmoe.layout
// CHECK-SAME: : tensor<4x64xbf16>
// ROW: util.global private @w13 {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x32xi8>
// ROW: util.global private @w13_scale {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x2xi8>
// ROW: util.global private @w13_bias {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "bias"} = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>
// ROW: util.global private @w2 {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "values"}
// ROW: util.global private @w2_scale {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "scales"}
// HOPPER: util.global private @w13 {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "values"}
// HOPPER: util.global private @w13_scale {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "scales"}
// HOPPER: util.global private @w13_bias {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "bias"}
// HOPPER: util.global private @w2 {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "values"}
// HOPPER: util.global private @w2_scale {mxmoe.layout = "triton-mxfp4-hopper", mxmoe.weight_role = "scales"}
// An unused global is left alone.
// CHECK: util.global private @unused = #flow.parameter
util.global private @router_weight = #flow.parameter.named<"model"::"router_weight"> : tensor<4x64xbf16>
util.global private @w13 = #flow.parameter.named<"model"::"w13"> : tensor<4x64x32xi8>
util.global private @w13_scale = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x2xi8>
util.global private @w13_bias = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>
util.global private @w2 = #flow.parameter.named<"model"::"w2"> : tensor<4x64x16xi8>
util.global private @w2_scale = #flow.parameter.named<"model"::"w2_scale"> : tensor<4x64x1xi8>
util.global private @unused = #flow.parameter.named<"model"::"unused"> : tensor<4x64x1xi8>

// CHECK-LABEL: func.func @fused
// CHECK: "mxmoe.route"
// CHECK-NOT: mxmoe.layout
// CHECK-SAME: -> (tensor<?x2xf32>, tensor<?x2xi32>)
// ROW: "mxmoe.grouped_matmul_glu"({{.*}}) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, has_bias = true, interleaved = true, limit = 7.000000e+00 : f32, mxmoe.layout = "mxfp4-rowmajor"}
// HOPPER: "mxmoe.grouped_matmul_glu"({{.*}}) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, has_bias = true, interleaved = true, limit = 7.000000e+00 : f32, mxmoe.layout = "triton-mxfp4-hopper"}
// ROW: "mxmoe.grouped_matmul_combine"({{.*}}) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"}
// HOPPER: "mxmoe.grouped_matmul_combine"({{.*}}) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"}
func.func @fused(%x: tensor<?x64xbf16>) -> tensor<?x64xbf16> {
  %rw = util.global.load @router_weight : tensor<4x64xbf16>
  %logits = "foo.linear"(%x, %rw) : (tensor<?x64xbf16>, tensor<4x64xbf16>) -> tensor<?x4xbf16>
  %w, %ids = "mxmoe.route"(%logits) {top_k = 2 : i64, routing = "topk_softmax", renormalize = false} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  %w13 = util.global.load @w13 : tensor<4x64x32xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x2xi8>
  %b13 = util.global.load @w13_bias : tensor<4x64xbf16>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13, %b13) {activation = "swiglu_oai", alpha = 1.702 : f32, has_bias = true, interleaved = true, limit = 7.0 : f32} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  %w2 = util.global.load @w2 : tensor<4x64x16xi8>
  %s2 = util.global.load @w2_scale : tensor<4x64x1xi8>
  // No bias: operand #4 holds the routing weights, which get no weight role.
  %o = "mxmoe.grouped_matmul_combine"(%a, %ids, %w2, %s2, %w) {has_bias = false} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  return %o : tensor<?x64xbf16>
}

// A plain grouped_matmul whose weights are function arguments (no globals): only the op is marked.
// CHECK-LABEL: func.func @weights_as_arguments
// ROW: "mxmoe.grouped_matmul"(%arg0, %arg1, %arg2, %arg3) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"}
// HOPPER: "mxmoe.grouped_matmul"(%arg0, %arg1, %arg2, %arg3) {has_bias = false, mxmoe.layout = "triton-mxfp4-hopper"}
// CHECK: "mxmoe.glu"
// CHECK-NOT: mxmoe.layout
// CHECK-SAME: -> tensor<?x2x32xbf16>
func.func @weights_as_arguments(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w13: tensor<4x64x32xi8>, %s13: tensor<4x64x2xi8>) -> tensor<?x2x32xbf16> {
  %h = "mxmoe.grouped_matmul"(%x, %ids, %w13, %s13) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xbf16>
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = true} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// RELAYOUT: assign-layout.mlir.tmp.once.mlir:{{[0-9]+}}:{{[0-9]+}}: error: 'mxmoe.grouped_matmul_glu' op already has weight layout 'mxfp4-rowmajor', but the target needs 'triton-mxfp4-hopper'

