// IREE 3.13: a rank-reducing tensor.extract_slice of an f4E2M1FN tensor breaks
// iree-dispatch-creation-bitcast-unsupported-element-types ("'linalg.generic' op expected operand #0 rank (3) to
// match the result rank of indexing_map (2)"). Workaround: slice the packed i8 bytes, then bitcast the slice (or
// gather whole experts with iree_linalg_ext.gather, as rocm_grouped.py does).
func.func @one_expert(%b8: tensor<8x256x16xi8>, %e: index) -> tensor<256x32xbf16> {
  %b4 = iree_tensor_ext.bitcast %b8 : tensor<8x256x16xi8> -> tensor<8x256x32xf4E2M1FN>
  %w4 = tensor.extract_slice %b4[%e, 0, 0] [1, 256, 32] [1, 1, 1] : tensor<8x256x32xf4E2M1FN> to tensor<256x32xf4E2M1FN>
  %o = tensor.empty() : tensor<256x32xbf16>
  %r = linalg.generic {indexing_maps = [affine_map<(n, k) -> (n, k)>, affine_map<(n, k) -> (n, k)>],
      iterator_types = ["parallel", "parallel"]} ins(%w4 : tensor<256x32xf4E2M1FN>) outs(%o : tensor<256x32xbf16>) {
  ^bb0(%w: f4E2M1FN, %y: bf16):
    %d = arith.extf %w : f4E2M1FN to bf16
    linalg.yield %d : bf16
  } -> tensor<256x32xbf16>
  return %r : tensor<256x32xbf16>
}
