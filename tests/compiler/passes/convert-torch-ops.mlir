// mxmoe-convert-torch-ops: `torch.operator "torch.mxmoe.*"` calls become mxmoe ops on builtin tensors; their
// scalar arguments (torch.constant.*) become attributes; tensors cross with torch_c.to/from_builtin_tensor;
// a weight loaded from a util.global is used directly. Every other torch op stays as it was.
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops | filecheck %s
// The result passes mxmoe-verify:
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-convert-torch-ops,mxmoe-verify > /dev/null
// The CPU target's pipeline up to lowering (compiler/pipeline.py) composes on the imported layer:
// RUN: mxmoe-opt %s --split-input-file --passes='mxmoe-convert-torch-ops,mxmoe-verify,mxmoe-fuse,mxmoe-pad{32},mxmoe-assign-layout{mxfp4-rowmajor},mxmoe-verify' | filecheck %s --check-prefix=PIPE
// PIPE: util.global private @w2_bias {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "bias"}
// PIPE: util.global private @w13 {mxmoe.layout = "mxfp4-rowmajor", mxmoe.weight_role = "values"}
// PIPE-LABEL: func.func @main
// PIPE: %[[R:.*]]:2 = "mxmoe.route"
// PIPE: %[[G:.*]] = "mxmoe.grouped_matmul_glu"(%{{.*}}, %[[R]]#1, %w13, %w13_scale, %w13_bias) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, has_bias = true, interleaved = true, limit = 7.000000e+00 : f32, mxmoe.layout = "mxfp4-rowmajor"} : {{.*}} -> tensor<?x2x96xbf16>
// PIPE: %[[O:.*]] = "mxmoe.grouped_matmul_combine"(%[[G]], %[[R]]#1, %w2, %w2_scale, %w2_bias, %[[R]]#0) {has_bias = true, mxmoe.layout = "mxfp4-rowmajor"} : {{.*}} -> tensor<?x64xbf16>
// PIPE-NEXT: torch_c.from_builtin_tensor %[[O]]
// PIPE-LABEL: func.func @args_no_bias

// A MoE layer as compiler/importer.py imports it (E=8, k=2, H=64, I=96, gpt-oss routing and activation).
// CHECK: util.global private @w13 = #flow.parameter.named<"model"::"w13"> : tensor<8x192x32xi8>
util.global private @w2_bias = #flow.parameter.named<"model"::"w2_bias"> : tensor<8x64xbf16>
util.global private @w2_scale = #flow.parameter.named<"model"::"w2_scale"> : tensor<8x64x3xi8>
util.global private @w2 = #flow.parameter.named<"model"::"w2"> : tensor<8x64x48xi8>
util.global private @w13_bias = #flow.parameter.named<"model"::"w13_bias"> : tensor<8x192xbf16>
util.global private @w13_scale = #flow.parameter.named<"model"::"w13_scale"> : tensor<8x192x2xi8>
util.global private @w13 = #flow.parameter.named<"model"::"w13"> : tensor<8x192x32xi8>
util.global private @router_bias = #flow.parameter.named<"model"::"router_bias"> : tensor<8xbf16>
util.global private @router_weight = #flow.parameter.named<"model"::"router_weight"> : tensor<8x64xbf16>
// CHECK-LABEL: func.func @main
// CHECK-SAME: (%[[ARG:[^:]*]]: !torch.vtensor<[?,64],bf16>)
func.func @main(%arg0: !torch.vtensor<[?,64],bf16>) -> !torch.vtensor<[?,64],bf16> {
  %int-1 = torch.constant.int -1
  %int64 = torch.constant.int 64
  %1 = torch.prim.ListConstruct %int-1, %int64 : (!torch.int, !torch.int) -> !torch.list<int>
  // CHECK: %[[X:.*]] = torch.aten.reshape %[[ARG]]
  %2 = torch.aten.reshape %arg0, %1 : !torch.vtensor<[?,64],bf16>, !torch.list<int> -> !torch.vtensor<[?,64],bf16>
  // The router's weights feed a torch op, so their bridge stays.
  // CHECK: %[[RW:.*]] = util.global.load @router_weight
  // CHECK-NEXT: %[[RWT:.*]] = torch_c.from_builtin_tensor %[[RW]]
  %router_weight = util.global.load @router_weight : tensor<8x64xbf16>
  %3 = torch_c.from_builtin_tensor %router_weight : tensor<8x64xbf16> -> !torch.vtensor<[8,64],bf16>
  %router_bias = util.global.load @router_bias : tensor<8xbf16>
  %4 = torch_c.from_builtin_tensor %router_bias : tensor<8xbf16> -> !torch.vtensor<[8],bf16>
  // CHECK: %[[LOGITS:.*]] = torch.aten.linear %[[X]], %[[RWT]], %{{.*}} : {{.*}} -> !torch.vtensor<[?,8],bf16>
  %5 = torch.aten.linear %2, %3, %4 : !torch.vtensor<[?,64],bf16>, !torch.vtensor<[8,64],bf16>, !torch.vtensor<[8],bf16> -> !torch.vtensor<[?,8],bf16>
  %int2 = torch.constant.int 2
  %str = torch.constant.str "topk_softmax"
  %false = torch.constant.bool false
  // CHECK: %[[L:.*]] = torch_c.to_builtin_tensor %[[LOGITS]] : !torch.vtensor<[?,8],bf16> -> tensor<?x8xbf16>
  // CHECK-NEXT: %[[R:.*]]:2 = "mxmoe.route"(%[[L]]) {renormalize = false, routing = "topk_softmax", top_k = 2 : i64} : (tensor<?x8xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  %6:2 = torch.operator "torch.mxmoe.route"(%5, %int2, %str, %false) : (!torch.vtensor<[?,8],bf16>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  // Expert weights: the ui8 vtensor bridges disappear, the i8 globals are read directly.
  // CHECK: %[[W13:.*]] = util.global.load @w13 : tensor<8x192x32xi8>
  // CHECK-NEXT: %[[S13:.*]] = util.global.load @w13_scale : tensor<8x192x2xi8>
  // CHECK-NEXT: %[[B13:.*]] = util.global.load @w13_bias : tensor<8x192xbf16>
  // CHECK-NEXT: %[[XB:.*]] = torch_c.to_builtin_tensor %[[X]] : !torch.vtensor<[?,64],bf16> -> tensor<?x64xbf16>
  // CHECK-NEXT: %[[H:.*]] = "mxmoe.grouped_matmul"(%[[XB]], %[[R]]#1, %[[W13]], %[[S13]], %[[B13]]) {has_bias = true} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<8x192x32xi8>, tensor<8x192x2xi8>, tensor<8x192xbf16>) -> tensor<?x2x192xbf16>
  %w13 = util.global.load @w13 : tensor<8x192x32xi8>
  %7 = torch_c.from_builtin_tensor %w13 : tensor<8x192x32xi8> -> !torch.vtensor<[8,192,32],ui8>
  %w13_scale = util.global.load @w13_scale : tensor<8x192x2xi8>
  %8 = torch_c.from_builtin_tensor %w13_scale : tensor<8x192x2xi8> -> !torch.vtensor<[8,192,2],ui8>
  %w13_bias = util.global.load @w13_bias : tensor<8x192xbf16>
  %9 = torch_c.from_builtin_tensor %w13_bias : tensor<8x192xbf16> -> !torch.vtensor<[8,192],bf16>
  %10 = torch.operator "torch.mxmoe.mxfp4_grouped_matmul"(%2, %6#1, %7, %8, %9) : (!torch.vtensor<[?,64],bf16>, !torch.vtensor<[?,2],si32>, !torch.vtensor<[8,192,32],ui8>, !torch.vtensor<[8,192,2],ui8>, !torch.vtensor<[8,192],bf16>) -> !torch.vtensor<[?,2,192],bf16>
  %str_0 = torch.constant.str "swiglu_oai"
  %float1.702000e00 = torch.constant.float 1.702000e+00
  %float7.000000e00 = torch.constant.float 7.000000e+00
  %true = torch.constant.bool true
  // CHECK: %[[A:.*]] = "mxmoe.glu"(%[[H]]) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, interleaved = true, limit = 7.000000e+00 : f32} : (tensor<?x2x192xbf16>) -> tensor<?x2x96xbf16>
  %11 = torch.operator "torch.mxmoe.glu"(%10, %str_0, %float1.702000e00, %float7.000000e00, %true) : (!torch.vtensor<[?,2,192],bf16>, !torch.str, !torch.float, !torch.float, !torch.bool) -> !torch.vtensor<[?,2,96],bf16>
  %w2 = util.global.load @w2 : tensor<8x64x48xi8>
  %12 = torch_c.from_builtin_tensor %w2 : tensor<8x64x48xi8> -> !torch.vtensor<[8,64,48],ui8>
  %w2_scale = util.global.load @w2_scale : tensor<8x64x3xi8>
  %13 = torch_c.from_builtin_tensor %w2_scale : tensor<8x64x3xi8> -> !torch.vtensor<[8,64,3],ui8>
  %w2_bias = util.global.load @w2_bias : tensor<8x64xbf16>
  %14 = torch_c.from_builtin_tensor %w2_bias : tensor<8x64xbf16> -> !torch.vtensor<[8,64],bf16>
  // The glu's result is used as a builtin tensor directly: no round trip through torch types.
  // CHECK: %[[Y:.*]] = "mxmoe.grouped_matmul"(%[[A]], %[[R]]#1, %{{.*}}, %{{.*}}, %{{.*}}) {has_bias = true} : (tensor<?x2x96xbf16>, tensor<?x2xi32>, tensor<8x64x48xi8>, tensor<8x64x3xi8>, tensor<8x64xbf16>) -> tensor<?x2x64xbf16>
  %15 = torch.operator "torch.mxmoe.mxfp4_grouped_matmul"(%11, %6#1, %12, %13, %14) : (!torch.vtensor<[?,2,96],bf16>, !torch.vtensor<[?,2],si32>, !torch.vtensor<[8,64,48],ui8>, !torch.vtensor<[8,64,3],ui8>, !torch.vtensor<[8,64],bf16>) -> !torch.vtensor<[?,2,64],bf16>
  // CHECK-NEXT: %[[O:.*]] = "mxmoe.combine"(%[[Y]], %[[R]]#0) : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  // CHECK-NEXT: %[[OT:.*]] = torch_c.from_builtin_tensor %[[O]] : tensor<?x64xbf16> -> !torch.vtensor<[?,64],bf16>
  %16 = torch.operator "torch.mxmoe.combine"(%15, %6#0) : (!torch.vtensor<[?,2,64],bf16>, !torch.vtensor<[?,2],f32>) -> !torch.vtensor<[?,64],bf16>
  // CHECK: %[[RES:.*]] = torch.aten.reshape %[[OT]]
  // CHECK-NEXT: return %[[RES]]
  %17 = torch.prim.ListConstruct %int-1, %int64 : (!torch.int, !torch.int) -> !torch.list<int>
  %18 = torch.aten.reshape %16, %17 : !torch.vtensor<[?,64],bf16>, !torch.list<int> -> !torch.vtensor<[?,64],bf16>
  return %18 : !torch.vtensor<[?,64],bf16>
}
// No custom-op call is left, and no bridge of an expert weight survives.
// CHECK-NOT: torch.operator
// CHECK-NOT: !torch.vtensor<[8,192,32],ui8>

// -----

// Weights passed as arguments (not globals) cross through to_builtin_tensor (ui8 -> i8); a missing bias
// (None) gives has_bias = false and 4 operands; softmax_topk routing with renormalize; an integer alpha
// becomes an f32 attribute; per-slot weights from another torch op are bridged too.
// CHECK-LABEL: func.func @args_no_bias
// CHECK-SAME: (%[[X:[^:]*]]: !torch.vtensor<[?,64],f32>, %[[L:[^:]*]]: !torch.vtensor<[?,4],f32>, %[[W:[^:]*]]: !torch.vtensor<[4,64,32],ui8>, %[[S:[^:]*]]: !torch.vtensor<[4,64,2],ui8>)
func.func @args_no_bias(%x: !torch.vtensor<[?,64],f32>, %l: !torch.vtensor<[?,4],f32>, %w: !torch.vtensor<[4,64,32],ui8>, %s: !torch.vtensor<[4,64,2],ui8>) -> !torch.vtensor<[?,2,32],f32> {
  %k = torch.constant.int 2
  %routing = torch.constant.str "softmax_topk"
  %renorm = torch.constant.bool true
  %none = torch.constant.none
  %act = torch.constant.str "silu"
  %alpha = torch.constant.int 1
  %limit = torch.constant.float 7.0
  %inter = torch.constant.bool false
  // CHECK: %[[LB:.*]] = torch_c.to_builtin_tensor %[[L]] : !torch.vtensor<[?,4],f32> -> tensor<?x4xf32>
  // CHECK-NEXT: %[[R:.*]]:2 = "mxmoe.route"(%[[LB]]) {renormalize = true, routing = "softmax_topk", top_k = 2 : i64}
  %r:2 = torch.operator "torch.mxmoe.route"(%l, %k, %routing, %renorm) : (!torch.vtensor<[?,4],f32>, !torch.int, !torch.str, !torch.bool) -> (!torch.vtensor<[?,2],f32>, !torch.vtensor<[?,2],si32>)
  // CHECK-DAG: %[[XB:.*]] = torch_c.to_builtin_tensor %[[X]] : !torch.vtensor<[?,64],f32> -> tensor<?x64xf32>
  // CHECK-DAG: %[[WB:.*]] = torch_c.to_builtin_tensor %[[W]] : !torch.vtensor<[4,64,32],ui8> -> tensor<4x64x32xi8>
  // CHECK-DAG: %[[SB:.*]] = torch_c.to_builtin_tensor %[[S]] : !torch.vtensor<[4,64,2],ui8> -> tensor<4x64x2xi8>
  // CHECK: %[[H:.*]] = "mxmoe.grouped_matmul"(%[[XB]], %[[R]]#1, %[[WB]], %[[SB]]) {has_bias = false} : (tensor<?x64xf32>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>) -> tensor<?x2x64xf32>
  %h = torch.operator "torch.mxmoe.mxfp4_grouped_matmul"(%x, %r#1, %w, %s, %none) : (!torch.vtensor<[?,64],f32>, !torch.vtensor<[?,2],si32>, !torch.vtensor<[4,64,32],ui8>, !torch.vtensor<[4,64,2],ui8>, !torch.none) -> !torch.vtensor<[?,2,64],f32>
  // CHECK: "mxmoe.glu"(%[[H]]) {activation = "silu", alpha = 1.000000e+00 : f32, interleaved = false, limit = 7.000000e+00 : f32} : (tensor<?x2x64xf32>) -> tensor<?x2x32xf32>
  %a = torch.operator "torch.mxmoe.glu"(%h, %act, %alpha, %limit, %inter) : (!torch.vtensor<[?,2,64],f32>, !torch.str, !torch.int, !torch.float, !torch.bool) -> !torch.vtensor<[?,2,32],f32>
  return %a : !torch.vtensor<[?,2,32],f32>
}

// -----

// NEGATIVE (not rewritten): a torch.operator of another namespace is left alone.
// CHECK-LABEL: func.func @other_custom_op
// CHECK: torch.operator "torch.other.route"(%arg0) : (!torch.vtensor<[?,4],f32>) -> !torch.vtensor<[?,4],f32>
// CHECK-NOT: mxmoe.
func.func @other_custom_op(%l: !torch.vtensor<[?,4],f32>) -> !torch.vtensor<[?,4],f32> {
  %0 = torch.operator "torch.other.route"(%l) : (!torch.vtensor<[?,4],f32>) -> !torch.vtensor<[?,4],f32>
  return %0 : !torch.vtensor<[?,4],f32>
}
