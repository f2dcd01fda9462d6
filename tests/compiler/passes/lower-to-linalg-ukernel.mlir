// mxmoe-lower-to-linalg{ukernel=PATH}: with the cpu microkernel object (mxmoe.kernels.cpu builds it),
// a blocksplit grouped matmul is two flow.dispatches (quantize the activation rows, then the grouped
// matvec) of stream.executables that call C symbols and carry the object for iree-compile to link, at
// every token count (no expert loop).
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s
// Row-major weights (the ROCm targets) ignore the option: no executable, no dispatch.
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s --check-prefix=ROWMAJOR
// A bad option is rejected by name:
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{object=/x.o}' 2>&1 | filecheck %s --check-prefix=BADOPT
// BADOPT: error: pass 'mxmoe-lower-to-linalg': unknown option '{object=/x.o}' (expected 'ukernel=PATH' or

util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x48xi8>
util.global private @w13_scale {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x3xi8>
util.global private @w13_bias {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "bias"} = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>

// Two executables carrying the object: the quantizer (a grid of ceil(slots / 4) workgroups) and the matvec
// (output tiles of 64, min(slots, experts)); each function hands its bindings to a C symbol as memrefs.
// CHECK: stream.executable private @[[QEXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_quantize]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[QEXE]] workgroups(%{{.+}}: index) -> (index, index, index)
// CHECK: %[[GROUPS:.+]] = arith.divui %{{.+}}, %{{.+}} : index
// CHECK: stream.return %[[GROUPS]], %{{.+}}, %{{.+}} : index, index, index
// CHECK: func.func private @mxmoe_mxfp4_quantize_rows(memref<?xbf16>, memref<?xi32>, memref<?xi16>, memref<?xf32>, index, index, index, index, index, index) attributes {hal.import.static}
// The rows of x [T, 96] bf16 (kind 1), row order[p] / 2 for top-2, 4 rows per workgroup:
// CHECK: call @mxmoe_mxfp4_quantize_rows(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c96, %c2, %c1, %c4, %{{.+}}, %workgroup_id_x)
// CHECK: stream.executable private @[[EXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_ukernel]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[EXE]] workgroups(%[[S:.+]]: index) -> (index, index, index)
// CHECK: %[[SLOTS:.+]] = arith.minui %[[S]], %{{.+}} : index
// CHECK: stream.return %{{.+}}, %[[SLOTS]], %{{.+}} : index, index, index
// CHECK: func.func private @mxmoe_mxfp4_grouped_matvec(memref<?xi16>, memref<?xf32>, memref<?xi8>, memref<?xi8>, memref<?xbf16>, memref<?xi64>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index) attributes {hal.import.static}
// CHECK: func.func @[[EXE]](
// CHECK: hal.interface.workgroup.id[0]
// CHECK: hal.interface.workgroup.id[1]
// N 64, K 96, bf16 bias (kind 1), deinterleaved gate/up (1), tiles of 64:
// CHECK: call @mxmoe_mxfp4_grouped_matvec({{(%[0-9]+, )+}}%c64, %c96, %c1, %c1, %c64, %workgroup_id_x, %workgroup_id_y)

// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_glu_
// The quantizer reads x itself (no gather); 96 = 3 blocks: two pairs (128 int16), 8 padded scales. Then one
// matvec dispatch for every used expert, reading the packed (id, first row, rows) table on the device and
// writing rows back to their slots (order), so the GLU reads halves [gate | up] of the f32 slot rows.
// CHECK-NOT: scf.if
// CHECK-NOT: tensor.extract {{.+}}xbf16
// CHECK: %[[Q:.+]]:2 = flow.dispatch @[[QEXE]]::@[[QEXE]][%[[NS:.+]]](%arg0, %[[ORDER:.+]], %{{.+}}, %[[NS]]) : (tensor<?x96xbf16>{%{{.+}}}, tensor<?xi32>{%[[NS]]}, index, index) -> (tensor<?x128xi16>{%[[NS]]}, tensor<?x8xf32>{%[[NS]]})
// CHECK-NOT: scf.for
// CHECK: %[[Y:.+]] = flow.dispatch @[[EXE]]::@[[EXE]][%[[NS]]](%[[Q]]#0, %[[Q]]#1, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %[[ORDER]], %[[NS]]) : (tensor<?x128xi16>{%[[NS]]}, tensor<?x8xf32>{%[[NS]]}, tensor<4x64x48xi8>, tensor<4x64x3xi8>, tensor<4x64xbf16>, tensor<4xi64>, tensor<1xi32>, tensor<?xi32>{%[[NS]]}, index) -> tensor<?x64xf32>{%[[NS]]}
// CHECK: tensor.expand_shape %[[Y]] {{\[}}[0, 1], [2]] output_shape [%{{.+}}, 2, 64] : tensor<?x64xf32> into tensor<?x2x64xf32>
// CHECK: tensor.extract_slice %{{.+}}[0, 0, 0] [%{{.+}}, 2, 32] [1, 1, 1] : tensor<?x2x64xf32> to tensor<?x2x32xf32>
// CHECK: tensor.extract_slice %{{.+}}[0, 0, 32] [%{{.+}}, 2, 32] [1, 1, 1] : tensor<?x2x64xf32> to tensor<?x2x32xf32>
// The GLU rounds each f32 input to bf16 itself (round to nearest even on the bits, NaN kept), no pass of its own:
// CHECK: linalg.generic {{.+}} ins(%{{.+}}, %{{.+}} : tensor<?x2x32xf32>, tensor<?x2x32xf32>) outs(%{{.+}} : tensor<?x2x32xbf16>)
// CHECK: arith.bitcast %{{.+}} : f32 to i32
// CHECK: arith.constant 32767 : i32
// CHECK: arith.constant -65536 : i32
// CHECK: arith.cmpf uno
// CHECK: math.exp
// CHECK-NOT: scf.for
// CHECK: return
func.func @glu(%x: tensor<?x96xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x32xbf16> {
  %w13 = util.global.load @w13 : tensor<4x64x48xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x3xi8>
  %b13 = util.global.load @w13_bias : tensor<4x64xbf16>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13, %b13) {activation = "swiglu_oai", alpha = 1.702 : f32, has_bias = true, interleaved = true, limit = 7.0 : f32, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x96xbf16>, tensor<?x2xi32>, tensor<4x64x48xi8>, tensor<4x64x3xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// ROWMAJOR-LABEL: func.func @rowmajor
// ROWMAJOR-NOT: flow.dispatch
// ROWMAJOR: return
// ROWMAJOR-NOT: stream.executable private @mxmoe_grouped_matmul_{{[0-9a-f]+}}_ukernel
func.func @rowmajor(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}
