// IREE 3.13 (rocm): arith.extf f4E2M1FN -> f8E4M3FN (exact: every e2m1 value is an e4m3 value) is expanded through
// f32 and the vector arith.truncf f32 -> f8E4M3FN left behind is not lowered ("missing
// LLVMTranslationDialectInterface registration ... arith.truncf"). Workaround (rocm_grouped.py, the mxfp8 form):
// re-encode the e2m1 codes to e4m3 bytes with integer ops.
func.func @f4_to_f8(%b8: tensor<256x16xi8>) -> tensor<256x32xi8> {
  %b4 = iree_tensor_ext.bitcast %b8 : tensor<256x16xi8> -> tensor<256x32xf4E2M1FN>
  %o = tensor.empty() : tensor<256x32xf8E4M3FN>
  %r = linalg.generic {indexing_maps = [affine_map<(n, k) -> (n, k)>, affine_map<(n, k) -> (n, k)>],
      iterator_types = ["parallel", "parallel"]} ins(%b4 : tensor<256x32xf4E2M1FN>) outs(%o : tensor<256x32xf8E4M3FN>) {
  ^bb0(%w: f4E2M1FN, %y: f8E4M3FN):
    %d = arith.extf %w : f4E2M1FN to f8E4M3FN
    linalg.yield %d : f8E4M3FN
  } -> tensor<256x32xf8E4M3FN>
  %r8 = iree_tensor_ext.bitcast %r : tensor<256x32xf8E4M3FN> -> tensor<256x32xi8>
  return %r8 : tensor<256x32xi8>
}
