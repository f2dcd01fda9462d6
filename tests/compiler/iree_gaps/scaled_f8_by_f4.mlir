// IREE 3.13 (gfx950): a scaled contraction of MXFP8 activations (f8E4M3FN) by MXFP4 weights (f4E2M1FN) compiles
// without any matrix instruction (IREE's scaled MMA layouts pair operands of one type only, although gfx950's
// v_mfma_scale_f32_16x16x128_f8f6f4 takes mixed formats). Workaround (rocm_grouped.py, the mxfp8 form): re-encode
// the weights to e4m3 in a producer generic and contract f8 x f8.
func.func @mxfp8_by_mxfp4(%a8: tensor<64x16x32xi8>, %as8: tensor<64x16xi8>, %b8: tensor<256x16x16xi8>,
                          %bs8: tensor<256x16xi8>) -> tensor<64x256xf32> {
  %a = iree_tensor_ext.bitcast %a8 : tensor<64x16x32xi8> -> tensor<64x16x32xf8E4M3FN>
  %b = iree_tensor_ext.bitcast %b8 : tensor<256x16x16xi8> -> tensor<256x16x32xf4E2M1FN>
  %as = iree_tensor_ext.bitcast %as8 : tensor<64x16xi8> -> tensor<64x16xf8E8M0FNU>
  %bs = iree_tensor_ext.bitcast %bs8 : tensor<256x16xi8> -> tensor<256x16xf8E8M0FNU>
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<64x256xf32>
  %acc = linalg.fill ins(%cst : f32) outs(%e : tensor<64x256xf32>) -> tensor<64x256xf32>
  %r = linalg.generic {
      indexing_maps = [affine_map<(m, n, kb, k) -> (m, kb, k)>, affine_map<(m, n, kb, k) -> (n, kb, k)>,
                       affine_map<(m, n, kb, k) -> (m, kb)>, affine_map<(m, n, kb, k) -> (n, kb)>,
                       affine_map<(m, n, kb, k) -> (m, n)>],
      iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
      ins(%a, %b, %as, %bs : tensor<64x16x32xf8E4M3FN>, tensor<256x16x32xf4E2M1FN>, tensor<64x16xf8E8M0FNU>,
          tensor<256x16xf8E8M0FNU>) outs(%acc : tensor<64x256xf32>) {
  ^bb0(%l: f8E4M3FN, %r: f4E2M1FN, %ls: f8E8M0FNU, %rs: f8E8M0FNU, %o: f32):
    %x = arith.scaling_extf %l, %ls : f8E4M3FN, f8E8M0FNU to f32
    %y = arith.scaling_extf %r, %rs : f4E2M1FN, f8E8M0FNU to f32
    %m = arith.mulf %x, %y : f32
    %s = arith.addf %o, %m : f32
    linalg.yield %s : f32
  } -> tensor<64x256xf32>
  return %r : tensor<64x256xf32>
}
