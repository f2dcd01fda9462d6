// The mxmoe-opt driver: pass listing, pipelines mixing mxmoe and upstream passes, stdin, split input files,
// and its errors (unknown pass, missing input). Parse errors are in opt-parse-error.mlir.

// RUN: mxmoe-opt --list-passes | filecheck %s --check-prefix=LIST
// LIST: mxmoe-convert-torch-ops: {{.*}}torch.operator
// LIST-NEXT: mxmoe-verify: check every mxmoe op
// LIST-NEXT: mxmoe-fuse: fold epilogues
// LIST-NEXT: mxmoe-pad: pad the K and N dims
// LIST-NEXT: mxmoe-assign-layout: record on every grouped matmul the weight layout
// LIST-NEXT: mxmoe-lower-to-linalg: mxmoe ops ->

// Upstream passes run in the same pipeline (canonicalize folds the arith ops; the mxmoe op stays).
// RUN: mxmoe-opt %s --passes=mxmoe-verify,canonicalize,mxmoe-verify | filecheck %s --check-prefix=PIPE
// The same from stdin:
// RUN: mxmoe-opt - --passes=canonicalize < %s | filecheck %s --check-prefix=PIPE
// PIPE-LABEL: func.func @fold
// PIPE-NEXT: %[[C:.*]] = arith.constant 5 : i32
// PIPE-NEXT: %[[G:.*]] = "mxmoe.glu"(%arg0) {activation = "silu"
// PIPE-NEXT: return %[[C]], %[[G]]

// Options in braces belong to their pass (upstream canonicalize takes two here); a bad one is named.
// RUN: mxmoe-opt %s --passes='canonicalize{max-iterations=2 test-convergence=false},mxmoe-verify' | filecheck %s --check-prefix=PIPE

// A pass that takes no option rejects one; unbalanced braces are named.
// RUN: not mxmoe-opt %s --passes='mxmoe-verify{x}' 2>&1 | filecheck %s --check-prefix=NOOPT
// NOOPT: error: pass 'mxmoe-verify' takes no option, got '{x}'
// RUN: not mxmoe-opt %s --passes='canonicalize{max-iterations=x}' 2>&1 | filecheck %s --check-prefix=BADOPT
// BADOPT: mxmoe-opt: error: bad option '{max-iterations=x}' for pass 'canonicalize'
// RUN: not mxmoe-opt %s --passes='mxmoe-pad{64' 2>&1 | filecheck %s --check-prefix=UNBAL
// UNBAL: error: pass pipeline 'mxmoe-pad{64': unbalanced '{'

// Without --passes the input is parsed and printed as is.
// RUN: mxmoe-opt %s | filecheck %s --check-prefix=NOPASS
// NOPASS-LABEL: func.func @fold
// NOPASS-NEXT: arith.constant 2 : i32
// NOPASS-NEXT: arith.constant 3 : i32
// NOPASS-NEXT: arith.addi

// --split-input-file runs each chunk on its own and joins the outputs with the marker.
// RUN: mxmoe-opt %s --split-input-file --passes=canonicalize | filecheck %s --check-prefix=SPLIT
// SPLIT-LABEL: func.func @fold
// SPLIT: // -----
// SPLIT-NEXT: module {
// SPLIT-NEXT: func.func @second

// Errors: an unknown pass (mxmoe or upstream) is named before any input is read.
// RUN: not mxmoe-opt %s --passes=mxmoe-verify,mxmoe-fusion 2>&1 | filecheck %s --check-prefix=UNKNOWN
// UNKNOWN: mxmoe-opt: error: unknown pass 'mxmoe-fusion' (mxmoe passes: mxmoe-convert-torch-ops, mxmoe-verify, mxmoe-fuse, mxmoe-pad, mxmoe-assign-layout, mxmoe-lower-to-linalg; or an upstream MLIR pass)
// UNKNOWN-NOT: module
// RUN: not mxmoe-opt %t.no-such-file.mlir --passes=mxmoe-verify 2>&1 | filecheck %s --check-prefix=NOFILE
// NOFILE: mxmoe-opt: error: cannot read {{.*}}no-such-file.mlir: No such file or directory
// RUN: not mxmoe-opt --passes=mxmoe-verify 2>&1 | filecheck %s --check-prefix=NOINPUT
// NOINPUT: error: an input file is required

func.func @fold(%h: tensor<?x64xf32>) -> (i32, tensor<?x32xf32>) {
  %a = arith.constant 2 : i32
  %b = arith.constant 3 : i32
  %c = arith.addi %a, %b : i32
  %g = "mxmoe.glu"(%h) {activation = "silu", alpha = 1.0 : f32, limit = 7.0 : f32, interleaved = false} : (tensor<?x64xf32>) -> tensor<?x32xf32>
  return %c, %g : i32, tensor<?x32xf32>
}

// -----

func.func @second() {
  return
}
