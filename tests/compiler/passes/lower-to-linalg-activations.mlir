// mxmoe-lower-to-linalg on the GLU activations beyond gpt-oss's: gelu (x/2 * (1 + erf(x/sqrt 2))), gelu_tanh
// (x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))) and silu_clamped (silu(min(gate, L)) * clamp(up, -L, L)),
// each one elementwise generic over the gate and up halves in f32. They compile for the cpu target:
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-lower-to-linalg | filecheck %s
// RUN: mxmoe-opt %s --split-input-file --passes=mxmoe-lower-to-linalg | iree-compile - --split-input-file --iree-hal-target-device=local --iree-hal-local-target-device-backends=llvm-cpu -o /dev/null

// CHECK-LABEL: func.func private @mxmoe_glu_
// CHECK: arith.constant 0.707106769 : f32
// CHECK: math.erf
// CHECK: arith.truncf {{.*}} : f32 to bf16
func.func @gelu(%h: tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16> {
  %a = "mxmoe.glu"(%h) {activation = "gelu", alpha = 1.702 : f32, interleaved = false, limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// -----

// CHECK-LABEL: func.func private @mxmoe_glu_
// CHECK: arith.constant 0.797884583 : f32
// CHECK: arith.constant 4.471500e-02 : f32
// CHECK: math.tanh
func.func @gelu_tanh(%h: tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16> {
  %a = "mxmoe.glu"(%h) {activation = "gelu_tanh", alpha = 1.702 : f32, interleaved = false, limit = 7.0 : f32} : (tensor<?x2x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// -----

// CHECK-LABEL: func.func private @mxmoe_glu_
// CHECK: arith.constant 1.000000e+01 : f32
// CHECK: arith.constant -1.000000e+01 : f32
// CHECK: arith.minimumf
// CHECK: arith.maximumf
// CHECK: math.exp
func.func @silu_clamped(%h: tensor<?x2x64xf32>) -> tensor<?x2x32xf32> {
  %a = "mxmoe.glu"(%h) {activation = "silu_clamped", alpha = 1.702 : f32, interleaved = true, limit = 10.0 : f32} : (tensor<?x2x64xf32>) -> tensor<?x2x32xf32>
  return %a : tensor<?x2x32xf32>
}
