// IREE 3.13 (rocm, gfx942 and gfx950): a reduction whose body multiplies by a value that is not a block argument
// (here a constant) stops with "'func.func' op failed to distribute" (the vector.contract it becomes has a splat
// operand, which VectorDistribute gives no layout). An expert read inside the body of the grouped matmul did this
// for K = 256, 768, 2048 (not 2880). Workaround (rocm_grouped.py): every contraction operand a block argument.
func.func @row_sum_times_two(%x: tensor<4x256xf32>) -> tensor<4xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4xf32>
  %acc = linalg.fill ins(%cst : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(t, k) -> (t, k)>, affine_map<(t, k) -> (t)>],
      iterator_types = ["parallel", "reduction"]} ins(%x : tensor<4x256xf32>) outs(%acc : tensor<4xf32>) {
  ^bb0(%xv: f32, %o: f32):
    %c2 = arith.constant 2.0 : f32
    %m = arith.mulf %xv, %c2 : f32
    %s = arith.addf %o, %m : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  return %r : tensor<4xf32>
}
