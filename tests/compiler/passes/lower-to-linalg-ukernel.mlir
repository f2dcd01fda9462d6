// mxmoe-lower-to-linalg{ukernel=PATH}: with the cpu microkernel object (mxmoe.kernels.cpu builds it),
// a blocksplit grouped matmul is three flow.dispatches (group the slots by expert, quantize the activation
// rows, then the grouped matvec) of stream.executables that call C symbols and carry the object for
// iree-compile to link, at every token count (no expert loop, no sort in linalg).
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s
// Row-major weights (the ROCm targets) ignore the option: no executable, no dispatch.
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s --check-prefix=ROWMAJOR
// activations=mxint16 is a form of the rows16 layout only:
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o,activations=mxint16}' 2>&1 | filecheck %s --check-prefix=BAD16
// BAD16: error: {{.+}} activations='mxint16' needs the weight layout 'cpu-mxfp4-rows16', got 'cpu-mxfp4-blocksplit'
// A bad option is rejected by name:
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{object=/x.o}' 2>&1 | filecheck %s --check-prefix=BADOPT
// BADOPT: error: pass 'mxmoe-lower-to-linalg': unknown option '{object=/x.o}' (expected 'ukernel=PATH' or

util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x48xi8>
util.global private @w13_scale {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x3xi8>
util.global private @w13_bias {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "bias"} = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>

// Three executables carrying the object: the grouping (one workgroup: a counting sort of the slots by
// expert, O(slots + experts), each expert's rows cut into work items of at most 64), the quantizer (a grid
// of ceil(slots / rows) workgroups, rows = max(4, ceil(slots / 256))) and the matvec (output tiles of 64,
// min(slots, experts) + slots / 64 + 1 work items); each function hands its bindings to a C symbol as memrefs.
// CHECK: stream.executable private @[[GEXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_group]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[GEXE]] workgroups(%{{.+}}: index) -> (index, index, index)
// CHECK: stream.return %[[ONE:.+]], %[[ONE]], %[[ONE]] : index, index, index
// CHECK: func.func private @mxmoe_group_slots(memref<?xi32>, memref<?xi32>, memref<?xi64>, memref<?xi32>, index, index, index) attributes {hal.import.static}
// ids [S] -> order [S], the work items [2 (E + S / 64)], (work items, valid slots); E = 4, chunks of 64:
// CHECK: %[[NI0:.+]] = arith.divui %{{.+}}, %c64 : index
// CHECK: %[[NI1:.+]] = arith.addi %[[NI0]], %c4 : index
// CHECK: arith.muli %[[NI1]], %c2 : index
// CHECK: call @mxmoe_group_slots(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c4, %c64)
// CHECK: stream.executable private @[[QEXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_quantize]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[QEXE]] workgroups(%{{.+}}: index) -> (index, index, index)
// CHECK: %[[PER:.+]] = arith.divui %{{.+}}, %c256 : index
// CHECK: %[[ROWS:.+]] = arith.maxui %[[PER]], %c4 : index
// CHECK: %[[GROUPS:.+]] = arith.divui %{{.+}}, %[[ROWS]] : index
// CHECK: stream.return %[[GROUPS]], %{{.+}}, %{{.+}} : index, index, index
// CHECK: func.func private @mxmoe_mxfp4_quantize_rows(memref<?xbf16>, memref<?xi32>, memref<?xi32>, memref<?xi16>, memref<?xf32>, index, index, index, index, index) attributes {hal.import.static}
// The rows of x [T, 96] bf16 (kind 1), row order[p] / 2 for top-2, the same rows per workgroup (only the
// valid slots'):
// CHECK: %[[QPER:.+]] = arith.divui %{{.+}}, %c256 : index
// CHECK: %[[QROWS:.+]] = arith.maxui %[[QPER]], %c4 : index
// CHECK: call @mxmoe_mxfp4_quantize_rows(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c96, %c2, %c1, %[[QROWS]], %workgroup_id_x)
// CHECK: stream.executable private @[[EXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_ukernel]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[EXE]] workgroups(%[[S:.+]]: index) -> (index, index, index)
// one workgroup row per possible work item, and one that zeroes the rows of the slots with no expert:
// CHECK: %[[USED:.+]] = arith.minui %[[S]], %{{.+}} : index
// CHECK: %[[WHOLE:.+]] = arith.divui %[[S]], %c64 : index
// CHECK: %[[ITEMS:.+]] = arith.addi %[[USED]], %[[WHOLE]] : index
// CHECK: %[[SLOTS:.+]] = arith.addi %[[ITEMS]], %{{.+}} : index
// CHECK: stream.return %{{.+}}, %[[SLOTS]], %{{.+}} : index, index, index
// The matvec writes the GLU's [S, 32] bf16 (its epilogue, kernels/cpu/glu_epilogue.c), not [S, 64] f32:
// CHECK: func.func private @mxmoe_mxfp4_grouped_matvec(memref<?xi16>, memref<?xf32>, memref<?xi8>, memref<?xi8>, memref<?xbf16>, memref<?xi64>, memref<?xi32>, memref<?xi32>, memref<?xbf16>, index, index, index, index, index, index, index, index, index, index, index, index, index) attributes {hal.import.static}
// CHECK: func.func @[[EXE]](
// CHECK: hal.interface.workgroup.id[0]
// CHECK: hal.interface.workgroup.id[1]
// S, N 64, K 96, bf16 activations (kind 1), bf16 bias (kind 1), interleaved gate/up (1), tiles of 64, then the
// epilogue: swiglu_oai (1), the bits of alpha 1.702 and limit 7.0, bf16 output (kind 1):
// CHECK: call @mxmoe_mxfp4_grouped_matvec({{(%[0-9]+, )+}}%arg9, %c64, %c96, %c1, %c1, %c1, %c64, %workgroup_id_x, %workgroup_id_y, %c1, %c1071242019, %c1088421888, %c1)

// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_glu_
// The grouping reads the flat ids. The quantizer reads x itself (no gather); 96 = 3 blocks: two pairs (128
// int16), 8 padded scales. Then one matvec dispatch for every used expert, reading the (first row, id |
// rows) table on the device and writing rows back to their slots (order), so the GLU reads halves
// [gate | up] of the f32 slot rows.
// CHECK-NOT: scf.if
// CHECK-NOT: linalg.generic
// CHECK-NOT: tensor.extract {{.+}}xbf16
// CHECK: %[[FLAT:.+]] = tensor.collapse_shape %arg1 {{\[}}[0, 1]] : tensor<?x2xi32> into tensor<?xi32>
// CHECK: %[[NI:.+]] = arith.muli %{{.+}}, %{{.+}} : index
// CHECK: %[[G:.+]]:3 = flow.dispatch @[[GEXE]]::@[[GEXE]][%[[NS:.+]]](%[[FLAT]], %[[NS]]) : (tensor<?xi32>{%[[NS]]}, index) -> (tensor<?xi32>{%[[NS]]}, tensor<?xi64>{%[[NI]]}, tensor<2xi32>)
// CHECK: %[[Q:.+]]:2 = flow.dispatch @[[QEXE]]::@[[QEXE]][%[[NS]]](%arg0, %[[G]]#0, %[[G]]#2, %{{.+}}, %[[NS]]) : (tensor<?x96xbf16>{%{{.+}}}, tensor<?xi32>{%[[NS]]}, tensor<2xi32>, index, index) -> (tensor<?x128xi16>{%[[NS]]}, tensor<?x8xf32>{%[[NS]]})
// CHECK-NOT: scf.for
// CHECK: %[[Y:.+]] = flow.dispatch @[[EXE]]::@[[EXE]][%[[NS]]](%[[Q]]#0, %[[Q]]#1, %{{.+}}, %{{.+}}, %{{.+}}, %[[G]]#1, %[[G]]#2, %[[G]]#0, %[[NS]]) : (tensor<?x128xi16>{%[[NS]]}, tensor<?x8xf32>{%[[NS]]}, tensor<4x64x48xi8>, tensor<4x64x3xi8>, tensor<4x64xbf16>, tensor<?xi64>{%[[NI]]}, tensor<2xi32>, tensor<?xi32>{%[[NS]]}, index) -> tensor<?x32xbf16>{%[[NS]]}
// The result as it is: no GLU generic after the kernel.
// CHECK: %[[R:.+]] = tensor.expand_shape %[[Y]] {{\[}}[0, 1], [2]] output_shape [%{{.+}}, 2, 32] : tensor<?x32xbf16> into tensor<?x2x32xbf16>
// CHECK-NOT: linalg.generic
// CHECK: return %[[R]]
func.func @glu(%x: tensor<?x96xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x32xbf16> {
  %w13 = util.global.load @w13 : tensor<4x64x48xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x3xi8>
  %b13 = util.global.load @w13_bias : tensor<4x64xbf16>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13, %b13) {activation = "swiglu_oai", alpha = 1.702 : f32, has_bias = true, interleaved = true, limit = 7.0 : f32, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x96xbf16>, tensor<?x2xi32>, tensor<4x64x48xi8>, tensor<4x64x3xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// Gelu with erf (no bias: kind 0) has no epilogue: the matvec writes [S, 64] f32 halves and the GLU generic follows (erf).
// CHECK: call @mxmoe_mxfp4_grouped_matvec({{(%[0-9]+, )+}}%arg9, %c64, %c96, %c1, %c0, %c1, %c64, %workgroup_id_x, %workgroup_id_y, %c0, %c0, %c0, %c2)
// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_glu_
// CHECK: flow.dispatch {{.+}} -> tensor<?x64xf32>
// CHECK: linalg.generic
// CHECK: math.erf
// CHECK: return
func.func @gelu(%x: tensor<?x96xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x32xbf16> {
  %w13 = util.global.load @w13 : tensor<4x64x48xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x3xi8>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13) {activation = "gelu", alpha = 1.0 : f32, has_bias = false, interleaved = true, limit = 7.0 : f32, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x96xbf16>, tensor<?x2xi32>, tensor<4x64x48xi8>, tensor<4x64x3xi8>) -> tensor<?x2x32xbf16>
  return %a : tensor<?x2x32xbf16>
}

// Gate/up halves (silu, no bias: kind 0): the epilogue pairs row j with row 32 + j (2), silu (2), f16 output (3):
// CHECK: call @mxmoe_mxfp4_grouped_matvec({{(%[0-9]+, )+}}%arg9, %c64, %c96, %c3, %c0, %c2, %c64, %workgroup_id_x, %workgroup_id_y, %c2, %c1065353216, %c1088421888, %c3)
// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_glu_
// CHECK: flow.dispatch {{.+}} -> tensor<?x32xf16>
// CHECK-NOT: linalg.generic
// CHECK: return
func.func @halves(%x: tensor<?x96xf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x32xf16> {
  %w13 = util.global.load @w13 : tensor<4x64x48xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x3xi8>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13) {activation = "silu", alpha = 1.0 : f32, has_bias = false, interleaved = false, limit = 7.0 : f32, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x96xf16>, tensor<?x2xi32>, tensor<4x64x48xi8>, tensor<4x64x3xi8>) -> tensor<?x2x32xf16>
  return %a : tensor<?x2x32xf16>
}

// ROWMAJOR-LABEL: func.func @rowmajor
// ROWMAJOR-NOT: flow.dispatch
// ROWMAJOR: return
// ROWMAJOR-NOT: stream.executable private @mxmoe_grouped_matmul_{{[0-9a-f]+}}_ukernel
func.func @rowmajor(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>, %w: tensor<4x96x32xi8>, %s: tensor<4x96x2xi8>) -> tensor<?x2x96xbf16> {
  %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false, mxmoe.layout = "mxfp4-rowmajor"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>) -> tensor<?x2x96xbf16>
  return %y : tensor<?x2x96xbf16>
}
