// mxmoe-lower-to-linalg on the ops of the fused-MoE interface: map_experts becomes one elementwise generic that
// reads the expert map at each valid id and writes -1 for an id outside [0, num_global); weight_rows one
// generic over (token, slot, h) that rounds the weight to the activation type (on the bits, for bf16) before the
// product. The functions compile with iree-compile for the cpu target:
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg > %t.mlir
// RUN: iree-compile %t.mlir --iree-hal-target-device=local --iree-hal-local-target-device-backends=llvm-cpu -o /dev/null

// CHECK-LABEL: func.func @main
// CHECK: call @mxmoe_map_experts_
// CHECK: call @mxmoe_weight_rows_
// CHECK-LABEL: func.func private @mxmoe_map_experts_
// CHECK-SAME: (%{{.*}}: tensor<?x2xi64>, %{{.*}}: tensor<16xi32>) -> tensor<?x2xi32>
// CHECK: linalg.generic
// CHECK: arith.cmpi sge
// CHECK: arith.cmpi slt
// CHECK: arith.constant -1 : i32
// CHECK: tensor.extract
// CHECK-LABEL: func.func private @mxmoe_weight_rows_
// CHECK-SAME: (%{{.*}}: tensor<?x64xbf16>, %{{.*}}: tensor<?x1xf32>) -> tensor<?x1x64xbf16>
// CHECK: linalg.generic {indexing_maps = [#{{.*}}, #{{.*}}, #{{.*}}]
// CHECK: arith.constant 32767 : i32
// CHECK: arith.mulf
// CHECK: arith.truncf {{.*}} : f32 to bf16
func.func @main(%g: tensor<?x2xi64>, %m: tensor<16xi32>, %x: tensor<?x64xbf16>, %w: tensor<?x1xf32>) -> (tensor<?x2xi32>, tensor<?x1x64xbf16>) {
  %a = "mxmoe.map_experts"(%g, %m) {num_global = 16 : i64, has_map = true} : (tensor<?x2xi64>, tensor<16xi32>) -> tensor<?x2xi32>
  %r = "mxmoe.weight_rows"(%x, %w) : (tensor<?x64xbf16>, tensor<?x1xf32>) -> tensor<?x1x64xbf16>
  return %a, %r : tensor<?x2xi32>, tensor<?x1x64xbf16>
}
