// mxmoe-lower-to-linalg{ukernel=PATH,activations=bf16} on bf16 weights in the cpu-mxfp4-rows16 layout (the cpu
// target's bf16 layers on hosts with AMX tiles): the three dispatches of the int8 forms, calling the bf16 form's C
// symbols: the grouping in work items of up to 128 rows (the form's row chunk), the packer (the bf16 rows themselves,
// permuted per block, each work item's rows in bands: [S, K] i16, and one unused f32 word a row; it reads the
// grouping's work-item table; the buffer's row count S is its last scalar) and the matmul (outputs in tiles of 64).
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o,activations=bf16}' | filecheck %s
// Without activations=bf16 the layout means the int8 form (mxint8), as before:
// RUN: mxmoe-opt %s --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o}' | filecheck %s --check-prefix=INT8
// INT8: call @mxmoe_rows16_grouped_matvec(
// No linalg form reads the layout:
// RUN: not mxmoe-opt %s --passes='mxmoe-lower-to-linalg{activations=bf16}' 2>&1 | filecheck %s --check-prefix=NOUK
// NOUK: error: 'mxmoe.grouped_matmul_combine' op weight layout 'cpu-mxfp4-rows16' (activations='mxint8' / 'mxint16' / 'bf16') is read by the cpu microkernel only: pass mxmoe-lower-to-linalg{ukernel=PATH}
// The form reads bf16 activations only (the cpu target keeps other layers' weights blocksplit):
// RUN: sed 's/x64xbf16/x64xf16/g; s/x96xbf16/x96xf16/g' %s | not mxmoe-opt - --passes='mxmoe-lower-to-linalg{ukernel=/objects/mxfp4_matvec.o,activations=bf16}' 2>&1 | filecheck %s --check-prefix=F16
// F16: error: 'mxmoe.grouped_matmul_combine' op weight layout 'cpu-mxfp4-rows16' with activations='bf16' reads bf16 activations, got f16 (the cpu target keeps other layers' weights blocksplit)

util.global private @w2 {mxmoe.layout = "cpu-mxfp4-rows16", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w2"> : tensor<4x96x32xi8>
util.global private @w2_scale {mxmoe.layout = "cpu-mxfp4-rows16", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w2_scale"> : tensor<4x96x2xi8>

// CHECK: stream.executable private @[[GEXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_group]]
// CHECK: call @mxmoe_group_slots(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c4, %c128)
// CHECK: stream.executable private @[[QEXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_quantize]]
// CHECK: func.func private @mxmoe_bf16_rows16_pack_rows(memref<?xbf16>, memref<?xi32>, memref<?xi32>, memref<?xi64>, memref<?xi16>, memref<?xf32>, index, index, index, index, index, index) attributes {hal.import.static}
// rows of x [T, 2, 64] bf16 (kind 1), one per slot (div 1), then the rows' workgroup and the buffer's rows S:
// CHECK: call @mxmoe_bf16_rows16_pack_rows(%{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %{{.+}}, %c64, %c1, %c1, %{{.+}}, %workgroup_id_x, %arg7)
// CHECK: stream.executable private @[[EXE:mxmoe_grouped_matmul_combine_[0-9a-f]+_ukernel]]
// CHECK: func.func private @mxmoe_bf16_rows16_grouped_matmul(memref<?xi16>, memref<?xf32>, memref<?xi8>, memref<?xi8>, memref<?xf32>, memref<?xi64>, memref<?xi32>, memref<?xi32>, memref<?xf32>, index, index, index, index, index, index, index, index, index, index, index, index) attributes {hal.import.static}
// S, N 96, K 64, no bias (kind 0), no deinterleave, tiles of 64 (TILE_N), no epilogue (f32 out, kind 2):
// CHECK: call @mxmoe_bf16_rows16_grouped_matmul({{(%[0-9]+, )+}}%arg9, %c96, %c64, %c0, %c0, %c64, %workgroup_id_x, %workgroup_id_y, %c0, %c0, %c0, %c2)

// CHECK-LABEL: func.func private @mxmoe_grouped_matmul_combine_
// CHECK: %[[G:.+]]:3 = flow.dispatch @[[GEXE]]::@[[GEXE]]
// CHECK: %[[Q:.+]]:2 = flow.dispatch @[[QEXE]]::@[[QEXE]][%[[NS:.+]]](%{{.+}}, %[[G]]#0, %[[G]]#2, %[[G]]#1, %{{.+}}, %[[NS]]) : (tensor<?x64xbf16>{%{{.+}}}, tensor<?xi32>{%[[NS]]}, tensor<2xi32>, tensor<?xi64>{%{{.+}}}, index, index) -> (tensor<?x64xi16>{%[[NS]]}, tensor<?x1xf32>{%[[NS]]})
// CHECK: flow.dispatch @[[EXE]]::@[[EXE]][%[[NS]]](%[[Q]]#0, %[[Q]]#1, %{{.+}}) : (tensor<?x64xi16>{%[[NS]]}, tensor<?x1xf32>{%[[NS]]}, tensor<4x96x32xi8>, tensor<4x96x2xi8>, tensor<1xf32>, {{.+}}) -> tensor<?x96xf32>{%[[NS]]}
// CHECK: return
func.func @rows16_bf16(%x: tensor<?x2x64xbf16>, %ids: tensor<?x2xi32>, %wt: tensor<?x2xf32>) -> tensor<?x96xbf16> {
  %w = util.global.load @w2 : tensor<4x96x32xi8>
  %s = util.global.load @w2_scale : tensor<4x96x2xi8>
  %y = "mxmoe.grouped_matmul_combine"(%x, %ids, %w, %s, %wt) {has_bias = false, mxmoe.layout = "cpu-mxfp4-rows16"} : (tensor<?x2x64xbf16>, tensor<?x2xi32>, tensor<4x96x32xi8>, tensor<4x96x2xi8>, tensor<?x2xf32>) -> tensor<?x96xbf16>
  return %y : tensor<?x96xbf16>
}
