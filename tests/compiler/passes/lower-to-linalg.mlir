// mxmoe-lower-to-linalg: every mxmoe op becomes a call of a private function of linalg/tensor/arith (one per
// distinct op signature); weights in the CPU layout get the grouped schedule (tokens sorted by expert, a
// host loop over the *used* experts only, decode fused into the kernels), row-major weights the portable
// one-generic form.
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s
// Nothing of the mxmoe dialect is left:
// RUN: mxmoe-opt %s --passes=mxmoe-lower-to-linalg | filecheck %s --check-prefix=GONE
// GONE-NOT: mxmoe.route
// GONE-NOT: "mxmoe.

util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x32xi8>
util.global private @w13_scale {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w13_scale"> : tensor<4x64x2xi8>
util.global private @w13_bias {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "bias"} = #flow.parameter.named<"model"::"w13_bias"> : tensor<4x64xbf16>
util.global private @w2 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w2"> : tensor<4x64x16xi8>
util.global private @w2_scale {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "scales"} = #flow.parameter.named<"model"::"w2_scale"> : tensor<4x64x1xi8>

// The block matvec's tile sizes are pinned (one row, 64 outputs x one 32-value block per workgroup step;
// vectors of 1 output x 2 nibble halves x 16 bytes, reduction over the blocks one at a time):
// CHECK: #[[CONFIG:.+]] = #iree_cpu.lowering_config<distribution = [1, 64, 2, 16, 0], vector_common_parallel = [1, 1, 2, 16, 0], vector_reduction = [0, 0, 0, 0, 1]>
// CHECK: #[[COMP:.+]] = #iree_codegen.compilation_info<lowering_config = #[[CONFIG]]

// The weights stay parameters: the globals are untouched.
// CHECK: util.global private @w13 {mxmoe.layout = "cpu-mxfp4-blocksplit", mxmoe.weight_role = "values"} = #flow.parameter.named<"model"::"w13"> : tensor<4x64x32xi8>

// CHECK-LABEL: func.func @moe(
// CHECK-SAME: %[[X:.+]]: tensor<?x64xbf16>, %[[LOGITS:.+]]: tensor<?x4xbf16>
// CHECK: %[[R:.+]]:2 = call @[[ROUTE:mxmoe_route_[0-9a-f]+]](%[[LOGITS]])
// CHECK: %[[W13:.+]] = util.global.load @w13
// CHECK: %[[S13:.+]] = util.global.load @w13_scale
// CHECK: %[[B13:.+]] = util.global.load @w13_bias
// CHECK: %[[A:.+]] = call @[[GLU:mxmoe_grouped_matmul_glu_[0-9a-f]+]](%[[X]], %[[R]]#1, %[[W13]], %[[S13]], %[[B13]])
// CHECK: %[[O:.+]] = call @[[COMBINE:mxmoe_grouped_matmul_combine_[0-9a-f]+]](%[[A]], %[[R]]#1, %{{.+}}, %{{.+}}, %[[R]]#0)
// CHECK: return %[[O]]
func.func @moe(%x: tensor<?x64xbf16>, %logits: tensor<?x4xbf16>) -> tensor<?x64xbf16> {
  %w, %ids = "mxmoe.route"(%logits) {top_k = 2 : i64, routing = "topk_softmax", renormalize = false} : (tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
  %w13 = util.global.load @w13 : tensor<4x64x32xi8>
  %s13 = util.global.load @w13_scale : tensor<4x64x2xi8>
  %b13 = util.global.load @w13_bias : tensor<4x64xbf16>
  %a = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %s13, %b13) {activation = "swiglu_oai", alpha = 1.702 : f32, has_bias = true, interleaved = true, limit = 7.0 : f32, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<4x64x32xi8>, tensor<4x64x2xi8>, tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
  %w2 = util.global.load @w2 : tensor<4x64x16xi8>
  %s2 = util.global.load @w2_scale : tensor<4x64x1xi8>
  %o = "mxmoe.grouped_matmul_combine"(%a, %ids, %w2, %s2, %w) {has_bias = false, mxmoe.layout = "cpu-mxfp4-blocksplit"} : (tensor<?x2x32xbf16>, tensor<?x2xi32>, tensor<4x64x16xi8>, tensor<4x64x1xi8>, tensor<?x2xf32>) -> tensor<?x64xbf16>
  return %o : tensor<?x64xbf16>
}

// Route: k rounds of an arg-max reduction (value, index) over the experts, then softmax over the k picks.
// CHECK: func.func private @[[ROUTE]](%{{.+}}: tensor<?x4xbf16>) -> (tensor<?x2xf32>, tensor<?x2xi32>)
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}}outs({{.*}} : tensor<?xf32>, tensor<?xi32>)
// CHECK: math.exp

// The w13 matmul + GLU, grouped schedule:
// CHECK: func.func private @[[GLU]](%[[GX:.+]]: tensor<?x64xbf16>, %[[GIDS:.+]]: tensor<?x2xi32>, %[[GW:.+]]: tensor<4x64x32xi8>, %[[GS:.+]]: tensor<4x64x2xi8>, %[[GB:.+]]: tensor<4x64xbf16>) -> tensor<?x2x32xbf16>
// 1. sort the T*k slots by expert on the device, a stable counting sort in linear work: each slot's bucket
// (its expert, or E = 4 for an id outside [0, E): no expert, sorted last), padded to chunks of 64 slots
// CHECK: %[[FLAT:.+]] = tensor.collapse_shape %[[GIDS]] {{\[}}[0, 1]] : tensor<?x2xi32> into tensor<?xi32>
// CHECK: %[[BK:.+]] = linalg.generic {{.*}}iterator_types = ["parallel"]} ins(%[[FLAT]] : tensor<?xi32>)
// CHECK: arith.cmpi ult
// CHECK: %[[BKP:.+]] = tensor.pad %[[BK]] low[0] high[%{{.+}}]
// CHECK: %[[BK2:.+]] = tensor.expand_shape %[[BKP]] {{\[}}[0, 1]] output_shape [%{{.+}}, 64] : tensor<?xi32> into tensor<?x64xi32>
// per-chunk bucket counts, scanned over the chunks; bucket totals and their offsets
// CHECK: %[[CC:.+]] = linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]} ins(%[[BK2]] : tensor<?x64xi32>) outs(%{{.+}} : tensor<?x5xi32>)
// CHECK: %[[SCAN:.+]]:2 = iree_linalg_ext.scan dimension(0) inclusive(false) ins(%[[CC]] : tensor<?x5xi32>)
// CHECK: %[[TOT:.+]] = linalg.generic {{.*}} ins(%[[CC]] : tensor<?x5xi32>) outs(%{{.+}} : tensor<5xi32>)
// CHECK: %[[OFF5:.+]] = linalg.generic {{.*}} ins(%[[TOT]] : tensor<5xi32>) outs(%{{.+}} : tensor<5xi32>)
// each slot's rank among the earlier slots of its chunk in its bucket (64 compares per slot, not T*k)
// CHECK: %[[RANK:.+]] = linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]} ins(%[[BK2]], %[[BK2]] : tensor<?x64xi32>, tensor<?x64xi32>)
// CHECK: %[[POS2:.+]] = linalg.generic {{.*}} ins(%[[BK2]], %[[RANK]] : tensor<?x64xi32>, tensor<?x64xi32>)
// CHECK: tensor.extract %[[OFF5]]
// CHECK: tensor.extract %[[SCAN]]#0
// CHECK: %[[POSC:.+]] = tensor.collapse_shape %[[POS2]]
// CHECK: %[[POS:.+]] = tensor.extract_slice %[[POSC]][0] [%{{.+}}] [1] : tensor<?xi32> to tensor<?xi32>
// order, the inverse permutation: a scatter of the slot indices to their positions
// CHECK: %[[IOTA:.+]] = linalg.generic
// CHECK: %[[IDX:.+]] = tensor.expand_shape %[[POS]]
// CHECK: %[[ORDER:.+]] = iree_linalg_ext.scatter dimension_map = [0] unique_indices(true) ins(%[[IOTA]], %[[IDX]] : tensor<?xi32>, tensor<?x1xi32>)
// the valid experts' counts and offsets; used experts, their number
// CHECK: %[[COUNTS:.+]] = tensor.extract_slice %[[TOT]][0] [4] [1] : tensor<5xi32> to tensor<4xi32>
// CHECK: %[[OFFS:.+]] = tensor.extract_slice %[[OFF5]][0] [4] [1] : tensor<5xi32> to tensor<4xi32>
// CHECK: %[[UIDX:.+]] = linalg.generic {{.*}} ins(%[[COUNTS]] : tensor<4xi32>) outs(%{{.+}} : tensor<4xi32>)
// CHECK: %[[USED:.+]] = linalg.generic {{.*}} ins(%[[COUNTS]], %[[UIDX]] : tensor<4xi32>, tensor<4xi32>)
// CHECK: %[[NUSED:.+]] = linalg.generic {{.*}} ins(%[[COUNTS]] : tensor<4xi32>) outs(%{{.+}} : tensor<i32>)
// info[u] = id | offset << 16 | rows << 40 of used expert u, one i64 read back per loop iteration
// CHECK: %[[INFO:.+]] = linalg.generic {{.*}} ins(%[[USED]] : tensor<4xi32>) outs(%{{.+}} : tensor<4xi64>)
// CHECK: tensor.extract %[[OFFS]][%{{.+}}] : tensor<4xi32>
// CHECK: tensor.extract %[[COUNTS]][%{{.+}}] : tensor<4xi32>
// CHECK: arith.shli %{{.+}}, %{{.+}} : i64
// 2. activations gathered in expert order, whole rows contiguous along K, converted to f32 once (not once
// per output row); both kernels read these rows, so no bf16 copy is gathered
// CHECK-NOT: outs(%{{.+}} : tensor<?x64xbf16>)
// CHECK: %[[XM:.+]] = linalg.generic {{.*}} ins(%[[ORDER]] : tensor<?xi32>) outs(%{{.+}} : tensor<?x64xf32>)
// CHECK: tensor.extract %[[GX]][%{{.+}}, %{{.+}}] : tensor<?x64xbf16>
// CHECK: arith.extf %{{.+}} : bf16 to f32
// CHECK-NOT: outs(%{{.+}} : tensor<?x64xbf16>)
// 3. a host loop whose trip count is the number of distinct experts picked (not E)
// up to 64 slots (T*k) and 32 tokens (so every expert takes the matvec): every expert's entry read back
// before the loop (one wait); each iteration picks its entry on the host (scf.index_switch over the E = 4
// entries), so the host never waits between experts
// CHECK: %[[FS:.+]] = arith.cmpi ule, %{{.+}}, %{{.+}} : index
// CHECK: %[[FT:.+]] = arith.cmpi ule, %{{.+}}, %{{.+}} : index
// CHECK: %[[FEW:.+]] = arith.andi %[[FS]], %[[FT]] : i1
// CHECK: %[[YS:.+]] = scf.if %[[FEW]] -> (tensor<?x64xf32>)
// each loop form reads the number of used experts back (the loop's trip count) inside its branch
// CHECK: %[[NU32:.+]] = tensor.extract %[[NUSED]][] : tensor<i32>
// CHECK: %[[NU:.+]] = arith.index_cast %[[NU32]] : i32 to index
// CHECK-COUNT-4: tensor.extract %[[INFO]][%{{.+}}] : tensor<4xi64>
// CHECK: scf.for %[[UA:.+]] = %{{.+}} to %[[NU]] step %{{.+}} iter_args
// CHECK-NOT: tensor.extract %[[INFO]]
// CHECK: scf.index_switch %[[UA]] -> i64
// CHECK: case 3 {
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]}
// CHECK: tensor.insert_slice
// otherwise each iteration reads the expert's id, then its offset and rows back (dependent reads: one
// expert's work in flight at a time, which keeps local-task from holding on to memory)
// CHECK: } else {
// CHECK: %[[NU32F:.+]] = tensor.extract %[[NUSED]][] : tensor<i32>
// CHECK: %[[NUF:.+]] = arith.index_cast %[[NU32F]] : i32 to index
// CHECK: %[[YSF:.+]] = scf.for %[[U:.+]] = %{{.+}} to %[[NUF]] step %{{.+}} iter_args(%{{.+}} = %{{.+}}) -> (tensor<?x64xf32>)
// CHECK-NOT: tensor<4xi64>
// CHECK: %[[UID:.+]] = tensor.extract %[[USED]][%[[U]]] : tensor<4xi32>
// CHECK: %[[EI:.+]] = arith.index_cast %[[UID]] : i32 to index
// CHECK: tensor.extract %[[OFFS]][%[[EI]]] : tensor<4xi32>
// CHECK: tensor.extract %[[COUNTS]][%[[EI]]] : tensor<4xi32>
// the expert's rows and its weights are slices at a dynamic offset: no byte gather
// CHECK: %[[XME:.+]] = tensor.extract_slice %[[XM]][%[[OFF:.+]], 0] [%[[CNT:.+]], 64] [1, 1] : tensor<?x64xf32> to tensor<?x64xf32>
// CHECK: %[[WE:.+]] = tensor.extract_slice %[[GW]][%[[E:.+]], 0, 0] [1, 64, 32] [1, 1, 1] : tensor<4x64x32xi8> to tensor<64x32xi8>
// CHECK: %[[SE:.+]] = tensor.extract_slice %[[GS]][%[[E]], 0, 0] [1, 64, 2] [1, 1, 1] : tensor<4x64x2xi8> to tensor<64x2xi8>
// CHECK: tensor.extract_slice %[[GB]][%[[E]], 0] [1, 64] [1, 1] : tensor<4x64xbf16> to tensor<64xbf16>
// few rows: the block matvec, decode in the body; (row, output, nibble half, byte) parallel, blocks reduced
// CHECK: %[[SMALL:.+]] = arith.cmpi ule, %[[CNT]], %{{.+}} : index
// CHECK: scf.if %[[SMALL]] -> (tensor<?x64xf32>)
// CHECK: tensor.expand_shape %[[XME]] {{\[}}[0], [1, 2, 3]] output_shape [%[[CNT]], 2, 2, 16] : tensor<?x64xf32> into tensor<?x2x2x16xf32>
// CHECK: tensor.expand_shape %[[WE]] {{\[}}[0], [1, 2]] output_shape [64, 2, 16] : tensor<64x32xi8> into tensor<64x2x16xi8>
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "parallel", "reduction"]} ins({{.*}} : tensor<?x2x2x16xf32>, tensor<64x2x16xi8>, tensor<64x2xi8>) outs({{.*}} : tensor<?x64x2x16xf32>) attrs =  {compilation_info = #[[COMP]]}
// the nibble as f16 bits (i16 ops: a multiply by 2^(12-4h) puts it at bits 12-15), one f16 -> f32 conversion
// CHECK: %[[NH:.+]] = linalg.index 2 : index
// CHECK: arith.extui %{{.+}} : i8 to i16
// CHECK: %[[P2:.+]] = arith.shli %{{.+}}, %{{.+}} : i16
// CHECK: %[[SH:.+]] = arith.muli %{{.+}}, %[[P2]] : i16
// an arithmetic shift right by 3 and one mask (sign bit and magnitude bits, 0x8E00) give the f16 pattern
// CHECK: %[[SR:.+]] = arith.shrsi %[[SH]], %{{.+}} : i16
// CHECK: %[[FB:.+]] = arith.andi %[[SR]], %{{.+}} : i16
// CHECK: %[[F:.+]] = arith.bitcast %[[FB]] : i16 to f16
// CHECK: arith.extf %[[F]] : f16 to f32
// CHECK-NOT: linalg.yield
// the product as an fma with a zero addend, then the add (not a contraction), nsz so LLVM fuses the two
// CHECK: math.fma {{.*}} fastmath<nsz,contract>
// CHECK: arith.addf
// CHECK: } -> tensor<?x64x2x16xf32>
// the 32 partial sums per output are summed by a second generic, the decode's 2^-14 multiplied back
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction", "reduction"]} ins({{.*}} : tensor<?x64x2x16xf32>) outs({{.*}} : tensor<?x64xf32>)
// CHECK: arith.constant 1.638400e+04 : f32
// CHECK: flow.tensor.tie_shape %{{.+}} : tensor<?x64xf32>{%[[CNT]]}
// many rows: decode the expert once (f32, value order), then a contraction over (K/32, 32)
// CHECK: } else {
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "parallel"]} ins({{.*}} : tensor<64x2x16xi8>, tensor<64x2xi8>) outs({{.*}} : tensor<64x2x2x16xf32>)
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction", "reduction"]} ins({{.*}} : tensor<?x2x32xf32>, tensor<64x2x32xf32>) outs({{.*}} : tensor<?x64xf32>)
// CHECK: tensor.insert_slice %{{.+}} into %{{.+}}[%[[OFF]], 0] [%[[CNT]], 64] [1, 1] : tensor<?x64xf32> into tensor<?x64xf32>
// 4. back to slot order, rounded to bf16 where the reference rounds, then the GLU; a slot with no expert
// (pos -1) reads zeros
// CHECK: flow.tensor.tie_shape %[[YSF]]
// CHECK: %[[YST:.+]] = flow.tensor.tie_shape %[[YS]]
// CHECK: %[[PM:.+]] = linalg.generic {{.*}} ins(%[[POS]], %{{.+}} : tensor<?xi32>, tensor<?xi32>)
// CHECK: arith.constant -1 : i32
// CHECK: tensor.expand_shape %[[PM]] {{\[}}[0, 1]]
// CHECK: tensor.extract %[[YST]][%{{.+}}, %{{.+}}] : tensor<?x64xf32>
// CHECK: arith.truncf %{{.+}} : f32 to bf16
// CHECK: arith.select
// CHECK: math.exp
// CHECK: return %{{.+}} : tensor<?x2x32xbf16>

// The w2 matmul + routing weights + combine: activations [T, k, I] are gathered per slot.
// CHECK: func.func private @[[COMBINE]](%[[CA:.+]]: tensor<?x2x32xbf16>, {{.*}}, %[[CW:.+]]: tensor<?x2xf32>) -> tensor<?x64xbf16>
// CHECK: %[[CAF:.+]] = tensor.collapse_shape %[[CA]] {{\[}}[0, 1], [2]] : tensor<?x2x32xbf16> into tensor<?x32xbf16>
// CHECK: tensor.extract %[[CAF]][%{{.+}}, %{{.+}}] : tensor<?x32xbf16>
// CHECK: scf.for
// The weighted sum over k: one parallel generic over the k slices (in order, from 0.0), unit stride
// CHECK: %[[Y0:.+]] = tensor.extract_slice %{{.+}}[0, 0, 0] [%{{.+}}, 1, 64] [1, 1, 1] : tensor<?x2x64xbf16> to tensor<?x64xbf16>
// CHECK: %[[Y1:.+]] = tensor.extract_slice %{{.+}}[0, 1, 0] [%{{.+}}, 1, 64] [1, 1, 1] : tensor<?x2x64xbf16> to tensor<?x64xbf16>
// CHECK: %[[W0:.+]] = tensor.extract_slice %[[CW]][0, 0] [%{{.+}}, 1] [1, 1] : tensor<?x2xf32> to tensor<?xf32>
// CHECK: %[[W1:.+]] = tensor.extract_slice %[[CW]][0, 1] [%{{.+}}, 1] [1, 1] : tensor<?x2xf32> to tensor<?xf32>
// CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "parallel"]} ins(%[[Y0]], %[[Y1]], %[[W0]], %[[W1]] : tensor<?x64xbf16>, tensor<?x64xbf16>, tensor<?xf32>, tensor<?xf32>) outs(%{{.+}} : tensor<?x64xf32>)
// CHECK: %[[P0:.+]] = arith.mulf %{{.+}}, %{{.+}} : f32
// CHECK: %[[A1:.+]] = arith.addf %{{.+}}, %[[P0]] : f32
// CHECK: %[[P1:.+]] = arith.mulf %{{.+}}, %{{.+}} : f32
// CHECK: arith.addf %[[A1]], %[[P1]] : f32
// CHECK: arith.truncf %{{.+}} : f32 to bf16
