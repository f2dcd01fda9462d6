// mxmoe-lower-to-linalg{ukernel=PATH}: with the cpu microkernel object (mxmoe.compiler.ukernels builds it),
// a blocksplit grouped matmul is one flow.dispatch of a stream.executable that calls the C symbol and
// carries the object for iree-compile to link, at every token count (no expert loop).
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s
// Row-major weights (the ROCm targets) ignore the option: no executable, no dispatch.
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s --check-prefix=ROWMAJOR
// A bad option is rejected by name:
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{object=/x.o}' 2>&1 | filecheck %s --check-prefix=BADOPT
// BADOPT: error: pass 'mxmoe-lower-to-linalg': unknown option '{object=/x.o}' (expected 'ukernel=PATH')

util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x48xi8>
util.global private @w13_scale {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x3xi8>
util.global private @w13_bias {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "bias"} = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>

// The executable: the object attached for the x86-64 embedded-ELF variant, a grid of (output tiles of 64,
// min(slots, experts)) workgroups, and a function that hands the bindings to the C symbol as memrefs.
// CHECK: stream.executable private @[[EXE:mxmoe_grouped_matmul_glu_[0-9a-f]+_ukernel]] attributes {hal.executable.objects = #hal.executable.objects<{#{{.+}} = [#hal.executable.object<{path = "/objects/mxfp4_matvec.o"}>]}>}
// CHECK: stream.executable.export public @[[EXE]] workgroups(%[[S:.+]]: index) -> (index, index, index)
// CHECK: %[[SLOTS:.+]] = arith.minui %[[S]], %{{.+}} : index
// CHECK: stream.return %{{.+}}, %[[SLOTS]], %{{.+}} : index, index, index
// CHECK: func.func private @mxmoe_mxfp4_grouped_matvec(memref<?xi16>, memref<?xf32>, memref<?xi8>, memref<?xi8>, memref<?xbf16>, memref<?xi64>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index) attributes {hal.import.static}
// CHECK: func.func @[[EXE]](
// CHECK: hal.interface.workgroup.id[0]
// CHECK: hal.interface.workgroup.id[1]
// CHECK: call @mxmoe_mxfp4_grouped_matvec(

// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_glu_
// Activations quantized to int16 per 32-value block (96 = 3 blocks: two pairs, the second padded), then
// one dispatch for every used expert, reading the packed (id, first row, rows) table on the device.
// CHECK-NOT: scf.if
// CHECK: math.roundeven
// CHECK: arith.fptosi %{{.+}} : f32 to i16
// CHECK: tensor.collapse_shape %{{.+}} {{\[}}[0], [1, 2, 3, 4]] : tensor<?x2x4x2x8xi16> into tensor<?x128xi16>
// CHECK: tensor.collapse_shape %{{.+}} {{\[}}[0], [1, 2, 3]] : tensor<?x2x2x4xf32> into tensor<?x16xf32>
// CHECK-NOT: scf.for
// CHECK: flow.dispatch @[[EXE]]::@[[EXE]][%{{.+}}](%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}) : (tensor<?x128xi16>{%{{.+}}}, tensor<?x16xf32>{%{{.+}}}, tensor<4x64x48xi8>, tensor<4x64x3xi8>, tensor<4x64xbf16>, tensor<4xi64>, tensor<1xi32>, index) -> tensor<?x64xf32>{%{{.+}}}
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
