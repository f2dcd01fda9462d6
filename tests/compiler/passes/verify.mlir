// mxmoe-verify accepts well-formed mxmoe ops at the edges of their contracts and leaves the IR as it was.
// (Rejections, one per broken rule, are in verify-invalid.mlir.)
// RUN: mxmoe-opt %s --passes=mxmoe-verify | filecheck %s
// RUN: mxmoe-opt %s > %t.in.mlir
// RUN: mxmoe-opt %s --passes=mxmoe-verify > %t.out.mlir
// RUN: diff %t.in.mlir %t.out.mlir

// Per-slot activations (T x k x K), f32, a static token count and top_k = E.
// CHECK-LABEL: func.func @per_slot_static
// CHECK: "mxmoe.route"(%{{.*}}) {renormalize = false, routing = "topk_softmax", top_k = 4 : i64} : (tensor<3x4xf32>) -> (tensor<3x4xf32>, tensor<3x4xi32>)
// CHECK: "mxmoe.grouped_matmul"(%{{.*}}) {has_bias = false} : (tensor<3x4x64xf32>, tensor<3x4xi32>, tensor<4x32x32xi8>, tensor<4x32x2xi8>) -> tensor<3x4x32xf32>
func.func @per_slot_static(%l: tensor<3x4xf32>, %x: tensor<3x4x64xf32>, %w: tensor<4x32x32xi8>, %s: tensor<4x32x2xi8>) -> tensor<3x4x32xf32> {
  %r:2 = "mxmoe.route"(%l) {top_k = 4 : i64, routing = "topk_softmax", renormalize = false} : (tensor<3x4xf32>) -> (tensor<3x4xf32>, tensor<3x4xi32>)
  %y = "mxmoe.grouped_matmul"(%x, %r#1, %w, %s) {has_bias = false} : (tensor<3x4x64xf32>, tensor<3x4xi32>, tensor<4x32x32xi8>, tensor<4x32x2xi8>) -> tensor<3x4x32xf32>
  return %y : tensor<3x4x32xf32>
}

// A static token count on one side and a dynamic one on the other agree; top_k = 1.
// CHECK-LABEL: func.func @mixed_static_dynamic
// CHECK: "mxmoe.route"(%{{.*}}) {renormalize = true, routing = "softmax_topk", top_k = 1 : i64} : (tensor<5x8xbf16>) -> (tensor<?x1xf32>, tensor<5x1xi32>)
func.func @mixed_static_dynamic(%l: tensor<5x8xbf16>) -> tensor<?x1xf32> {
  %r:2 = "mxmoe.route"(%l) {top_k = 1 : i64, routing = "softmax_topk", renormalize = true} : (tensor<5x8xbf16>) -> (tensor<?x1xf32>, tensor<5x1xi32>)
  return %r#0 : tensor<?x1xf32>
}

// glu on any rank >= 1; an integer-valued alpha/limit is accepted for a float attribute.
// CHECK-LABEL: func.func @glu_ranks
// CHECK: "mxmoe.glu"(%{{.*}}) {activation = "silu", alpha = 1 : i64, interleaved = false, limit = 7 : i64} : (tensor<64xf16>) -> tensor<32xf16>
func.func @glu_ranks(%h: tensor<64xf16>) -> tensor<32xf16> {
  %a = "mxmoe.glu"(%h) {activation = "silu", alpha = 1 : i64, limit = 7 : i64, interleaved = false} : (tensor<64xf16>) -> tensor<32xf16>
  return %a : tensor<32xf16>
}

// Extra (discardable) mxmoe.* attributes are allowed; ops of other dialects, even unregistered ones, are not checked.
// CHECK-LABEL: func.func @extra_attrs
// CHECK: "mxmoe.combine"(%{{.*}}, %{{.*}}) {mxmoe.note = "kept"} : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
// CHECK: "foo.anything"(%{{.*}}) {top_k = "not checked"} : (tensor<?x64xbf16>) -> tensor<?x64xbf16>
func.func @extra_attrs(%y: tensor<?x2x64xbf16>, %w: tensor<?x2xf32>) -> tensor<?x64xbf16> {
  %o = "mxmoe.combine"(%y, %w) {mxmoe.note = "kept"} : (tensor<?x2x64xbf16>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  %p = "foo.anything"(%o) {top_k = "not checked"} : (tensor<?x64xbf16>) -> tensor<?x64xbf16>
  return %p : tensor<?x64xbf16>
}

// Expert parallelism: global ids (i64 from an engine) mapped through an expert map; without a map only the range.
// CHECK-LABEL: func.func @map_experts_forms
// CHECK: "mxmoe.map_experts"(%{{.*}}, %{{.*}}) {has_map = true, num_global = 16 : i64} : (tensor<?x2xi64>, tensor<16xi32>) -> tensor<?x2xi32>
// CHECK: "mxmoe.map_experts"(%{{.*}}) {has_map = false, num_global = 8 : i64} : (tensor<?x2xi32>) -> tensor<?x2xi32>
func.func @map_experts_forms(%g: tensor<?x2xi64>, %m: tensor<16xi32>, %l: tensor<?x2xi32>) -> (tensor<?x2xi32>, tensor<?x2xi32>) {
  %a = "mxmoe.map_experts"(%g, %m) {num_global = 16 : i64, has_map = true} : (tensor<?x2xi64>, tensor<16xi32>) -> tensor<?x2xi32>
  %b = "mxmoe.map_experts"(%l) {num_global = 8 : i64, has_map = false} : (tensor<?x2xi32>) -> tensor<?x2xi32>
  return %a, %b : tensor<?x2xi32>, tensor<?x2xi32>
}

// Router weight on input: one row per slot.
// CHECK-LABEL: func.func @weight_rows_form
// CHECK: "mxmoe.weight_rows"(%{{.*}}, %{{.*}}) : (tensor<?x64xbf16>, tensor<?x1xf32>) -> tensor<?x1x64xbf16>
func.func @weight_rows_form(%x: tensor<?x64xbf16>, %w: tensor<?x1xf32>) -> tensor<?x1x64xbf16> {
  %r = "mxmoe.weight_rows"(%x, %w) : (tensor<?x64xbf16>, tensor<?x1xf32>) -> tensor<?x1x64xbf16>
  return %r : tensor<?x1x64xbf16>
}
