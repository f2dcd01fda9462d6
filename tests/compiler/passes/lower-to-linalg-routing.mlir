// mxmoe-lower-to-linalg on the routings of docs/routing.md. sigmoid_topk: sigmoid scores (1 / (1 + exp(-x))),
// the correction bias added for choosing, the group limit (each group's two largest values from one reduction over
// the group axis of an expand_shape, then topk_group masked arg-max rounds on the group scores), k arg-max rounds,
// the chosen scores gathered back (not the biased values), renormalised with the sum in slot order plus 1e-20 (as f32: 9.99999968E-21),
// then scaled. topk_sigmoid: k arg-max rounds on the logits, then the sigmoid of the chosen. The functions compile
// with iree-compile for the cpu target:
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-lower-to-linalg | filecheck %s
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-lower-to-linalg | iree-compile - --split-input-file --iree-hal-target-device=local --iree-hal-local-target-device-backends=llvm-cpu -o /dev/null

// CHECK-LABEL: func.func @deepseek
// CHECK: call @[[R:mxmoe_route_[0-9a-f]+]](%{{.*}}, %{{.*}}) : (tensor<?x8xf32>, tensor<8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
// CHECK-LABEL: func.func private @mxmoe_route_
// CHECK-SAME: (%{{[^:]*}}: tensor<?x8xf32>, %[[BIAS:[^:]*]]: tensor<8xf32>)
// CHECK: math.exp
// CHECK: arith.divf
// CHECK: ins(%{{.*}}, %[[BIAS]] : tensor<?x8xf32>, tensor<8xf32>)
// CHECK: arith.addf
// CHECK: tensor.expand_shape {{.*}} {{\[\[}}0], [1, 2]] output_shape [%{{.*}}, 4, 2] : tensor<?x8xf32> into tensor<?x4x2xf32>
// CHECK: iterator_types = ["parallel", "parallel", "reduction"]
// CHECK: linalg.yield %{{.*}}, %{{.*}} : f32, f32
// CHECK: tensor.collapse_shape {{.*}} : tensor<?x4x2xf32> into tensor<?x8xf32>
// CHECK: tensor.extract %{{.*}}[%{{.*}}, %{{.*}}] : tensor<?x8xf32>
// CHECK: arith.constant 9.99999968E-21 : f32
// CHECK: arith.constant 2.500000e+00 : f32
// CHECK: arith.mulf
func.func @deepseek(%l: tensor<?x8xf32>, %bias: tensor<8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>) {
  %w, %ids = "mxmoe.route"(%l, %bias) {top_k = 2 : i64, routing = "sigmoid_topk", renormalize = true, has_score_bias = true, n_group = 4 : i64, topk_group = 2 : i64, scaling = 2.5 : f32} : (tensor<?x8xf32>, tensor<8xf32>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return %w, %ids : tensor<?x2xf32>, tensor<?x2xi32>
}

// -----

// Without a bias or groups the weights are the values the arg-max picked (no gather), not renormalised.
// CHECK-LABEL: func.func private @mxmoe_route_
// CHECK-SAME: (%{{[^:]*}}: tensor<?x8xbf16>) ->
// CHECK: math.exp
// CHECK-NOT: tensor.expand_shape
// CHECK-NOT: tensor.extract %
// CHECK-NOT: 9.99999968E-21
// CHECK: return
func.func @sigmoid_plain(%l: tensor<?x8xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>) {
  %w, %ids = "mxmoe.route"(%l) {top_k = 2 : i64, routing = "sigmoid_topk", renormalize = false} : (tensor<?x8xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  return %w, %ids : tensor<?x2xf32>, tensor<?x2xi32>
}

// -----

// Llama-4: the arg-max first (on the logits), the sigmoid of the chosen logit after.
// CHECK-LABEL: func.func private @mxmoe_route_
// CHECK-SAME: (%{{[^:]*}}: tensor<?x16xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>)
// CHECK: iterator_types = ["parallel", "reduction"]
// CHECK: tensor.insert_slice
// CHECK: math.exp
// CHECK: return
func.func @llama4(%l: tensor<?x16xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>) {
  %w, %ids = "mxmoe.route"(%l) {top_k = 1 : i64, routing = "topk_sigmoid", renormalize = false} : (tensor<?x16xbf16>) -> (tensor<?x1xf32>, tensor<?x1xi32>)
  return %w, %ids : tensor<?x1xf32>, tensor<?x1xi32>
}
