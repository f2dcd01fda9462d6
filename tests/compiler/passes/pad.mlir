// RUN: mxmoe-opt %s --passes='mxmoe-pad{64}' --split-input-file | filecheck %s
// RUN: not mxmoe-opt %s --passes='mxmoe-pad{48}' 2>&1 | filecheck %s --check-prefix=BADOPT

// BADOPT: mxmoe-pad: the multiple must be a positive multiple of 32, got '48'

// H = 96 and I = 32 both pad to 64-multiples: H -> 128, I -> 64 (w13 rows 2I: 64 -> 128).
// The globals are retyped and say how to pad the stored arrays; the activation is padded along K
// with zeros and each result is sliced back to its logical size.

// CHECK-LABEL: util.global private @w13
// CHECK-SAME: mxmoe.pad_value = 0
// CHECK-SAME: mxmoe.padded_from = array<i64: 2, 64, 48>
// CHECK-SAME: tensor<2x128x64xi8>
// CHECK: util.global private @w13_scale
// CHECK-SAME: mxmoe.pad_value = 127
// CHECK-SAME: mxmoe.padded_from = array<i64: 2, 64, 3>
// CHECK-SAME: tensor<2x128x4xi8>
// CHECK: util.global private @w13_bias
// CHECK-SAME: mxmoe.padded_from = array<i64: 2, 64>
// CHECK-SAME: tensor<2x128xbf16>
// CHECK: util.global private @w2
// CHECK-SAME: mxmoe.padded_from = array<i64: 2, 96, 16>
// CHECK-SAME: tensor<2x128x32xi8>
// CHECK-NOT: mxmoe.pad_halves
// CHECK-LABEL: func.func @moe
// CHECK-SAME: (%[[X:.*]]: tensor<?x96xbf16>, %[[IDS:.*]]: tensor<?x1xi32>, %[[RW:.*]]: tensor<?x1xf32>)
// CHECK: %[[W13:.*]] = util.global.load @w13 : tensor<2x128x64xi8>
// CHECK: %[[XP:.*]] = tensor.pad %[[X]] low[0, 0] high[0, 32]
// CHECK: : tensor<?x96xbf16> to tensor<?x128xbf16>
// CHECK: %[[H:.*]] = "mxmoe.grouped_matmul_glu"(%[[XP]], %[[IDS]], %[[W13]],
// CHECK-SAME: -> tensor<?x1x64xbf16>
// CHECK-NOT: tensor.pad
// CHECK: %[[Y:.*]] = "mxmoe.grouped_matmul_combine"(%[[H]], %[[IDS]],
// CHECK-SAME: -> tensor<?x128xbf16>
// CHECK: %[[YS:.*]] = tensor.extract_slice %[[Y]][0, 0] [%{{.*}}, 96] [1, 1] : tensor<?x128xbf16> to tensor<?x96xbf16>
// CHECK: return %[[YS]]
module {
  util.global private @w13 = #flow.parameter.named<"model"::"w13"> : tensor<2x64x48xi8>
  util.global private @w13_scale = #flow.parameter.named<"model"::"w13_scale"> : tensor<2x64x3xi8>
  util.global private @w13_bias = #flow.parameter.named<"model"::"w13_bias"> : tensor<2x64xbf16>
  util.global private @w2 = #flow.parameter.named<"model"::"w2"> : tensor<2x96x16xi8>
  util.global private @w2_scale = #flow.parameter.named<"model"::"w2_scale"> : tensor<2x96x1xi8>
  func.func @moe(%x: tensor<?x96xbf16>, %ids: tensor<?x1xi32>, %rw: tensor<?x1xf32>) -> tensor<?x96xbf16> {
    %w13 = util.global.load @w13 : tensor<2x64x48xi8>
    %w13_scale = util.global.load @w13_scale : tensor<2x64x3xi8>
    %w13_bias = util.global.load @w13_bias : tensor<2x64xbf16>
    %h = "mxmoe.grouped_matmul_glu"(%x, %ids, %w13, %w13_scale, %w13_bias) {activation = "swiglu_oai", alpha = 1.702000e+00 : f32, has_bias = true, interleaved = true, limit = 7.000000e+00 : f32} : (tensor<?x96xbf16>, tensor<?x1xi32>, tensor<2x64x48xi8>, tensor<2x64x3xi8>, tensor<2x64xbf16>) -> tensor<?x1x32xbf16>
    %w2 = util.global.load @w2 : tensor<2x96x16xi8>
    %w2_scale = util.global.load @w2_scale : tensor<2x96x1xi8>
    %y = "mxmoe.grouped_matmul_combine"(%h, %ids, %w2, %w2_scale, %rw) {has_bias = false} : (tensor<?x1x32xbf16>, tensor<?x1xi32>, tensor<2x96x16xi8>, tensor<2x96x1xi8>, tensor<?x1xf32>) -> tensor<?x96xbf16>
    return %y : tensor<?x96xbf16>
  }
}

// -----

// Concatenated (not interleaved) gate|up: the w13 globals are marked to pad each half.
// CHECK-LABEL: util.global private @cw13
// CHECK-SAME: mxmoe.pad_halves
// CHECK-SAME: tensor<2x128x32xi8>
module {
  util.global private @cw13 = #flow.parameter.named<"model"::"cw13"> : tensor<2x64x32xi8>
  util.global private @cw13_scale = #flow.parameter.named<"model"::"cw13_scale"> : tensor<2x64x2xi8>
  func.func @concat(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x32xbf16> {
    %w = util.global.load @cw13 : tensor<2x64x32xi8>
    %s = util.global.load @cw13_scale : tensor<2x64x2xi8>
    %h = "mxmoe.grouped_matmul_glu"(%x, %ids, %w, %s) {activation = "silu", alpha = 1.0 : f32, has_bias = false, interleaved = false, limit = 7.0 : f32} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<2x64x32xi8>, tensor<2x64x2xi8>) -> tensor<?x2x32xbf16>
    return %h : tensor<?x2x32xbf16>
  }
}

// -----

// Already a multiple of 64: nothing changes.
// CHECK-LABEL: func.func @aligned
// CHECK-NOT: tensor.pad
// CHECK-NOT: mxmoe.padded_from
// CHECK: "mxmoe.grouped_matmul"(%{{.*}}) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<2x64x32xi8>, tensor<2x64x2xi8>) -> tensor<?x2x64xbf16>
module {
  util.global private @aw = #flow.parameter.named<"model"::"aw"> : tensor<2x64x32xi8>
  util.global private @as = #flow.parameter.named<"model"::"as"> : tensor<2x64x2xi8>
  func.func @aligned(%x: tensor<?x64xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x64xbf16> {
    %w = util.global.load @aw : tensor<2x64x32xi8>
    %s = util.global.load @as : tensor<2x64x2xi8>
    %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<2x64x32xi8>, tensor<2x64x2xi8>) -> tensor<?x2x64xbf16>
    return %y : tensor<?x2x64xbf16>
  }
}

// -----

// Two functions (entry points of one layer) read the same globals: the first op pads them, the second finds them
// padded and pads only its activation and result.
// CHECK-LABEL: util.global private @sw
// CHECK-SAME: mxmoe.padded_from = array<i64: 2, 96, 16>
// CHECK-SAME: tensor<2x128x32xi8>
// CHECK-LABEL: func.func @first
// CHECK: tensor.pad %{{.*}} low[0, 0] high[0, 32]
// CHECK: "mxmoe.grouped_matmul"(%{{.*}}) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<2x128x32xi8>, tensor<2x128x2xi8>) -> tensor<?x2x128xbf16>
// CHECK: tensor.extract_slice %{{.*}}[0, 0, 0] [%{{.*}}, 2, 96] [1, 1, 1] : tensor<?x2x128xbf16> to tensor<?x2x96xbf16>
// CHECK-LABEL: func.func @second
// CHECK: util.global.load @sw : tensor<2x128x32xi8>
// CHECK: tensor.pad %{{.*}} low[0, 0] high[0, 32]
// CHECK: "mxmoe.grouped_matmul"(%{{.*}}) {has_bias = false} : (tensor<?x64xbf16>, tensor<?x2xi32>, tensor<2x128x32xi8>, tensor<2x128x2xi8>) -> tensor<?x2x128xbf16>
// CHECK: tensor.extract_slice %{{.*}}[0, 0, 0] [%{{.*}}, 2, 96] [1, 1, 1] : tensor<?x2x128xbf16> to tensor<?x2x96xbf16>
module {
  util.global private @sw = #flow.parameter.named<"model"::"sw"> : tensor<2x96x16xi8>
  util.global private @ss = #flow.parameter.named<"model"::"ss"> : tensor<2x96x1xi8>
  func.func @first(%x: tensor<?x32xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x96xbf16> {
    %w = util.global.load @sw : tensor<2x96x16xi8>
    %s = util.global.load @ss : tensor<2x96x1xi8>
    %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x32xbf16>, tensor<?x2xi32>, tensor<2x96x16xi8>, tensor<2x96x1xi8>) -> tensor<?x2x96xbf16>
    return %y : tensor<?x2x96xbf16>
  }
  func.func @second(%x: tensor<?x32xbf16>, %ids: tensor<?x2xi32>) -> tensor<?x2x96xbf16> {
    %w = util.global.load @sw : tensor<2x96x16xi8>
    %s = util.global.load @ss : tensor<2x96x1xi8>
    %y = "mxmoe.grouped_matmul"(%x, %ids, %w, %s) {has_bias = false} : (tensor<?x32xbf16>, tensor<?x2xi32>, tensor<2x96x16xi8>, tensor<2x96x1xi8>) -> tensor<?x2x96xbf16>
    return %y : tensor<?x2x96xbf16>
  }
}
