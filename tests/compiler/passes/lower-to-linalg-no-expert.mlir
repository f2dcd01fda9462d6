// A slot whose expert id is outside [0, E) (the fused-MoE interface's -1: "not on this rank") contributes
// nothing: its grouped_matmul output row is 0 (no bias), and it costs no work. The ids are a runtime
// tensor, so the rule is in the lowering; tests/compiler/test_cpu_target.py runs it.
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s --check-prefix=UK

// Linalg schedule: one unsigned compare sends every id outside [0, 5) (negative ones included) to bucket 5,
// which sorts after all experts and is never iterated (the loop runs over used experts, counted from
// buckets 0..4 only); unsorting reads -1 for those slots and writes 0.
// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel"]} ins(%{{.+}} : tensor<?xi32>)
// CHECK: %[[E:.+]] = arith.constant 5 : i32
// CHECK: %[[OK:.+]] = arith.cmpi ult, %{{.+}}, %[[E]] : i32
// CHECK: arith.select %[[OK]], %{{.+}}, %[[E]] : i32
// CHECK: tensor.extract_slice %{{.+}}[0] [5] [1] : tensor<6xi32> to tensor<5xi32>
// CHECK: scf.for
// CHECK: %[[M1:.+]] = arith.constant -1 : i32
// CHECK: arith.select %{{.+}}, %{{.+}}, %[[M1]] : i32
// CHECK: %[[Z:.+]] = arith.constant 0 : i32
// CHECK: %[[VALID:.+]] = arith.cmpi sge, %{{.+}}, %[[Z]] : i32
// CHECK: %[[Y:.+]] = arith.truncf %{{.+}} : f32 to bf16
// CHECK: %[[ZERO:.+]] = arith.constant 0.000000e+00 : bf16
// CHECK: arith.select %[[VALID]], %[[Y]], %[[ZERO]] : bf16

// Microkernel: mxmoe_group_slots puts such slots after the valid ones and counts the valid ones; the
// quantizer only reads the valid rows, and the matvec grid has one workgroup row per possible used expert
// plus one that writes zeros to the other slots' rows.
// UK: func.func private @mxmoe_group_slots(
// UK: call @mxmoe_group_slots(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c5, %c64)
// UK: %[[USED:.+]] = arith.minui %{{.+}}, %{{.+}} : index
// UK: %[[WHOLE:.+]] = arith.divui
// UK: %[[ITEMS:.+]] = arith.addi %[[USED]], %[[WHOLE]] : index
// UK: arith.addi %[[ITEMS]], %{{.+}} : index
// UK-LABEL: func.func private @mxmoe_grouped_matmul_
// UK-NOT: arith.select
// UK: %[[G:.+]]:3 = flow.dispatch @{{.+}}_group::
// UK: flow.dispatch @{{.+}}_quantize::{{.+}}(%{{.+}}, %[[G]]#0, %[[G]]#2,
// UK: flow.dispatch @{{.+}}_ukernel::{{.+}}(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %[[G]]#1, %[[G]]#2, %[[G]]#0,
func.func @plain(%x: tensor<?x64xbf16>, %ids: tensor<?x3xi32>, %w: tensor<5x96x32xi8>, %s: tensor<5x96x2xi8>, %b: tensor<5x96xbf16>) -> tensor<?x3x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s, %b) {has_bias = true, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x64xbf16>, tensor<?x3xi32>, tensor<5x96x32xi8>, tensor<5x96x2xi8>, tensor<5x96xbf16>) -> tensor<?x3x96xbf16>
  return %y : tensor<?x3x96xbf16>
}
