// A file that does not parse: mxmoe-opt reports MLIR's parse error at FILE:LINE:COL and exits 1, printing nothing.
// RUN: not mxmoe-opt %s --passes=mxmoe-verify 2>&1 | filecheck %s
// With --split-input-file, the broken chunk is reported at its line in the whole file and the other chunks
// still run and print.
// RUN: not mxmoe-opt %s --split-input-file --passes=mxmoe-verify 2>&1 | filecheck %s --check-prefix=SPLIT

func.func @good(%h: tensor<?x64xf32>) -> tensor<?x32xf32> {
  %g = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = false} : (tensor<?x64xf32>) -> tensor<?x32xf32>
  return %g : tensor<?x32xf32>
}

// -----

func.func @broken(%h: tensor<?x64xf32>) -> tensor<?x32xf32> {
  // CHECK: opt-parse-error.mlir:[[# @LINE + 2]]:{{[0-9]+}}: error: use of undeclared SSA value name
  // SPLIT: opt-parse-error.mlir:[[# @LINE + 1]]:{{[0-9]+}}: error: use of undeclared SSA value name
  %g = "mxmoe.glu"(%nope) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = false} : (tensor<?x64xf32>) -> tensor<?x32xf32>
  return %g : tensor<?x32xf32>
}
// CHECK-NOT: func.func
// SPLIT: func.func @good
// SPLIT-NOT: func.func @broken
