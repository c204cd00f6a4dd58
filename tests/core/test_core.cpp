// Tests of the core floor: dtype conversions (bf16 ties, fp16, fp8 saturation / NaN / subnormals with
// exact known codes), Tensor views and copies, Philox known-answer vectors and the named-stream fillers,
// and memory accounting by category. No kernels here: tests/kernels covers ops.h.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_test.h"
#include "moecore/core/backend_hooks.h"
#include "moecore/core/dtype.h"
#include "moecore/core/dtype_convert.h"
#include "moecore/core/env.h"
#include "moecore/core/memory.h"
#include "moecore/core/rng.h"
#include "moecore/core/tensor.h"

namespace moecore {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f8e4m3), 1u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  EXPECT_EQ(dtype_name(DType::bf16), "bf16");
  EXPECT_EQ(dtype_name(DType::f8e5m2), "f8e5m2");
  EXPECT_TRUE(dtype_is_float(DType::f8e5m2));
  EXPECT_FALSE(dtype_is_float(DType::i32));
  EXPECT_FALSE(dtype_is_float(DType::boolean));
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 lies exactly between 0x3f80 and 0x3f81: the tie goes to the even code 0x3f80.
  EXPECT_EQ(float_to_bf16(1.00390625f).bits, 0x3f80);
  // 1 + 3 * 2^-8 lies between 0x3f81 and 0x3f82: the tie goes to 0x3f82.
  EXPECT_EQ(float_to_bf16(1.01171875f).bits, 0x3f82);
  EXPECT_EQ(float_to_bf16(from_bits(0x3f808001)).bits, 0x3f81);  // just above the tie rounds up
  EXPECT_EQ(float_to_bf16(from_bits(0x3f807fff)).bits, 0x3f80);  // just below rounds down
  EXPECT_EQ(float_to_bf16(-2.0f).bits, 0xc000);
  EXPECT_EQ(float_to_bf16(kInf).bits, 0x7f80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()).bits, 0x7f80);  // beyond bf16's max: inf
  EXPECT_EQ(float_to_bf16(from_bits(0x7f7f7fff)).bits, 0x7f7f);              // bf16's max stays finite
  const bf16 nan = float_to_bf16(from_bits(0x7f800001));                     // signalling NaN
  EXPECT_TRUE(std::isnan(bf16_to_float(nan)));
  EXPECT_EQ(nan.bits & 0x40, 0x40);                              // quiet
  EXPECT_EQ(float_to_bf16(from_bits(0x00010000)).bits, 0x0001);  // subnormals keep their top bits
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const bf16 h{static_cast<uint16_t>(code)};
    if (std::isnan(bf16_to_float(h))) continue;
    ASSERT_EQ(float_to_bf16(bf16_to_float(h)).bits, code);
  }
}

TEST(DType, Fp16KnownValues) {
  EXPECT_EQ(float_to_f16(1.0f).bits, 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f).bits, 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f).bits, 0x7bff);                      // max finite
  EXPECT_EQ(float_to_f16(65519.0f).bits, 0x7bff);                      // below the midpoint to 2^16
  EXPECT_EQ(float_to_f16(65520.0f).bits, 0x7c00);                      // the midpoint rounds (to even) to infinity
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)).bits, 0x0001);         // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)).bits, 0x0000);         // half of it: tie to even (0)
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -26)).bits, 0x0001);         // 0.75 of it rounds up
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)).bits, 0x0002);         // 1.5 of it: tie to even (2)
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -14)).bits, 0x0400);         // smallest normal
  EXPECT_EQ(float_to_f16(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);  // tie to even
  EXPECT_EQ(float_to_f16(-kInf).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(kNaN))));
  EXPECT_EQ(f16_to_float(f16{0x7bff}), 65504.0f);
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const f16 h{static_cast<uint16_t>(code)};
    if (std::isnan(f16_to_float(h))) continue;
    ASSERT_EQ(float_to_f16(f16_to_float(h)).bits, code);
  }
}

// The fast bit-manipulation f16 conversions against the frexp-based reference: every half, and for f32 -> f16
// every float near a half (each half's value and its midpoints to both neighbours, +-3 ulps), the boundaries,
// NaNs with payloads, float subnormals, and a stride through all 2^32 bit patterns.
TEST(DType, Fp16FastEqualsReference) {
  const auto same_bits = [](float a, float b) { return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b); };
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const auto h = static_cast<uint16_t>(code);
    ASSERT_TRUE(same_bits(f16_bits_to_float(h), dtype_convert::f16_to_float_reference(h))) << std::hex << code;
  }
  const auto check = [](uint32_t u) {
    const float f = from_bits(u);
    ASSERT_EQ(float_to_f16_bits(f), dtype_convert::float_to_f16_reference(f)) << std::hex << u;
  };
  for (uint32_t code = 0; code < 0x7c00; ++code) {
    const float lo = dtype_convert::f16_to_float_reference(static_cast<uint16_t>(code));
    const float hi =
        code + 1 < 0x7c00 ? dtype_convert::f16_to_float_reference(static_cast<uint16_t>(code + 1)) : 65536.0f;
    for (const float center : {lo, lo + (hi - lo) / 2}) {
      const uint32_t c = std::bit_cast<uint32_t>(center);
      for (uint32_t d = 0; d <= 6; ++d) {
        if (c + d < 3) continue;
        for (const uint32_t sign : {0u, 0x80000000u}) check((c + d - 3) | sign);
      }
    }
  }
  for (uint32_t u = 0; u < 0x1000; ++u) {
    for (const uint32_t base : {0x00000000u, 0x007ff000u, 0x7f800000u, 0x7fc00000u, 0x7ffff000u, 0x47000000u,
                                0x477fe000u, 0x387ff000u, 0x38800000u, 0x33000000u, 0x32fff800u})
      for (const uint32_t sign : {0u, 0x80000000u}) check((base + u) | sign);
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 251) check(static_cast<uint32_t>(u));
}

TEST(DType, Fp8E4m3KnownValues) {
  EXPECT_EQ(float_to_f8e4m3(1.0f).bits, 0x38);
  EXPECT_EQ(float_to_f8e4m3(448.0f).bits, 0x7e);  // max finite
  EXPECT_EQ(float_to_f8e4m3(464.0f).bits, 0x7e);  // saturates rather than rounding into the NaN code
  EXPECT_EQ(float_to_f8e4m3(1e6f).bits, 0x7e);
  EXPECT_EQ(float_to_f8e4m3(-1e6f).bits, 0xfe);
  EXPECT_EQ(float_to_f8e4m3(kInf).bits, 0x7e);  // e4m3fn has no infinity
  EXPECT_EQ(float_to_f8e4m3(-kInf).bits, 0xfe);
  EXPECT_EQ(float_to_f8e4m3(kNaN).bits & 0x7f, 0x7f);
  EXPECT_EQ(float_to_f8e4m3(0.001953125f).bits, 0x01);           // 2^-9, the smallest subnormal
  EXPECT_EQ(float_to_f8e4m3(std::ldexp(1.0f, -10)).bits, 0x00);  // half of it: tie to even
  EXPECT_EQ(float_to_f8e4m3(std::ldexp(3.0f, -11)).bits, 0x01);  // 0.75 of it rounds up
  EXPECT_EQ(float_to_f8e4m3(std::ldexp(1.0f, -6)).bits, 0x08);   // smallest normal
  EXPECT_EQ(float_to_f8e4m3(std::ldexp(7.0f, -9)).bits, 0x07);   // largest subnormal
  EXPECT_EQ(float_to_f8e4m3(1.0625f).bits, 0x38);                // 1 + 2^-4: tie to even
  EXPECT_EQ(float_to_f8e4m3(-0.0f).bits, 0x80);
  EXPECT_EQ(f8e4m3_to_float(f8e4m3{0x7e}), 448.0f);
  EXPECT_EQ(f8e4m3_to_float(f8e4m3{0x01}), 0.001953125f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_float(f8e4m3{0x7f})));
  EXPECT_TRUE(std::isnan(f8e4m3_to_float(f8e4m3{0xff})));
  for (uint32_t code = 0; code < 256; ++code) {
    const f8e4m3 v{static_cast<uint8_t>(code)};
    if (std::isnan(f8e4m3_to_float(v))) continue;
    ASSERT_EQ(float_to_f8e4m3(f8e4m3_to_float(v)).bits, code);
  }
}

TEST(DType, Fp8E5m2KnownValues) {
  EXPECT_EQ(float_to_f8e5m2(1.0f).bits, 0x3c);
  EXPECT_EQ(float_to_f8e5m2(57344.0f).bits, 0x7b);  // max finite
  EXPECT_EQ(float_to_f8e5m2(60000.0f).bits, 0x7b);  // finite overflow saturates
  EXPECT_EQ(float_to_f8e5m2(-1e9f).bits, 0xfb);
  EXPECT_EQ(float_to_f8e5m2(kInf).bits, 0x7c);  // infinities stay infinite
  EXPECT_EQ(float_to_f8e5m2(-kInf).bits, 0xfc);
  EXPECT_EQ(float_to_f8e5m2(std::ldexp(1.0f, -16)).bits, 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_f8e5m2(std::ldexp(1.0f, -17)).bits, 0x00);  // half of it: tie to even
  EXPECT_EQ(float_to_f8e5m2(std::ldexp(1.0f, -14)).bits, 0x04);  // smallest normal
  EXPECT_EQ(float_to_f8e5m2(1.125f).bits, 0x3c);                 // 1 + 2^-3: tie to even
  EXPECT_EQ(float_to_f8e5m2(1.375f).bits, 0x3e);                 // 1 + 3 * 2^-3: tie to even
  EXPECT_TRUE(std::isnan(f8e5m2_to_float(float_to_f8e5m2(kNaN))));
  EXPECT_EQ(f8e5m2_to_float(f8e5m2{0x7b}), 57344.0f);
  EXPECT_EQ(f8e5m2_to_float(f8e5m2{0x7c}), kInf);
  for (uint32_t code = 0; code < 256; ++code) {
    const f8e5m2 v{static_cast<uint8_t>(code)};
    if (std::isnan(f8e5m2_to_float(v))) continue;
    ASSERT_EQ(float_to_f8e5m2(f8e5m2_to_float(v)).bits, code);
  }
}

TEST(DType, ConvertBetweenTypes) {
  const float src[4] = {1.5f, -2.0f, 3.0f, 448.0f};
  int32_t i32[4];
  convert(i32, DType::i32, src, DType::f32, 4);
  EXPECT_EQ(i32[0], 1);
  EXPECT_EQ(i32[1], -2);
  int64_t i64[4];
  convert(i64, DType::i64, i32, DType::i32, 4);
  EXPECT_EQ(i64[3], 448);
  bf16 h[4];
  convert(h, DType::bf16, src, DType::f32, 4);
  f8e4m3 e[4];
  convert(e, DType::f8e4m3, h, DType::bf16, 4);
  float back[4];
  convert(back, DType::f32, e, DType::f8e4m3, 4);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(back[i], src[i]);  // all four are exact in e4m3
  bool b[4];
  convert(b, DType::boolean, src, DType::f32, 4);
  EXPECT_TRUE(b[0]);
}

// Base tensor [2, 3, 4] holding 0..23.
Tensor iota_tensor() {
  Tensor t = Tensor::empty(Shape{2, 3, 4}, DType::f32, MemCategory::other);
  for (int i = 0; i < 24; ++i) t.data<float>()[i] = static_cast<float>(i);
  return t;
}

std::vector<float> values(const Tensor& t) {
  Tensor c = t.to(DType::f32);
  return std::vector<float>(c.data<float>(), c.data<float>() + c.numel());
}

TEST(Tensor, ShapeStridesAndStr) {
  Tensor t = iota_tensor();
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.size(-2), 3);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.str(), "[2, 3, 4] f32");
  EXPECT_EQ(t.nbytes(), 96);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % 64, 0u);
  EXPECT_THROW(t.data<bf16>(), Error);
}

// Regression (issue 15): numel() wrapped around for [2^32, 2^32] (undefined behaviour), so a file could declare a
// huge tensor that "needed" 0 bytes. Counts that exceed int64 now throw naming the shape.
TEST(Tensor, NumelAndBytesAreOverflowChecked) {
  const int64_t big = int64_t{1} << 32;
  const Shape huge{big, big};
  try {
    (void)huge.numel();
    ADD_FAILURE() << "no error for " << huge.str();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[4294967296, 4294967296]"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)Shape({int64_t{1} << 61, 2, 2}).numel(), Error);
  EXPECT_EQ(Shape({int64_t{1} << 61, 2}).numel(), int64_t{1} << 62);
  EXPECT_THROW((void)Shape({int64_t{1} << 61, 2}).bytes(DType::f32), Error);  // 2^64 bytes
  EXPECT_EQ(Shape({int64_t{1} << 59, 2}).bytes(DType::f32), int64_t{1} << 62);
  EXPECT_EQ(Shape({big, big, 0}).numel(), 0);  // a zero dim makes the product 0 whatever the others
  EXPECT_THROW(Tensor::empty(huge, DType::f32), Error);
  const Tensor z = Tensor::empty({0, big, big}, DType::f32);  // no storage needed, strides stay defined
  EXPECT_EQ(z.numel(), 0);
  EXPECT_EQ(z.nbytes(), 0);
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = iota_tensor();
  Tensor v = t.view(Shape{6, 4});
  EXPECT_EQ(v.str(), "[6, 4] f32");
  v.data<float>()[5] = 100.0f;
  EXPECT_EQ(t.data<float>()[5], 100.0f);
  EXPECT_EQ(t.flatten_to_2d().shape(), (Shape{6, 4}));
  EXPECT_THROW(t.view(Shape{5, 5}), Error);

  Tensor s = t.slice(1, 1, 3);  // [2, 2, 4], rows 1..2 of each batch
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(values(s), (std::vector<float>{4, 100, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23}));
  EXPECT_THROW(s.view(Shape{16}), Error);
  EXPECT_THROW(t.slice(1, 2, 4), Error);

  Tensor row = t.select(0, 1);  // [3, 4], contiguous
  EXPECT_TRUE(row.is_contiguous());
  EXPECT_EQ(row.shape(), (Shape{3, 4}));
  EXPECT_EQ(values(row)[0], 12.0f);

  Tensor col = t.select(2, 1);  // [2, 3], strides [12, 4]
  EXPECT_EQ(col.shape(), (Shape{2, 3}));
  EXPECT_EQ(col.stride(0), 12);
  EXPECT_EQ(col.stride(1), 4);
  EXPECT_EQ(values(col), (std::vector<float>{1, 100, 9, 13, 17, 21}));  // 5 was overwritten above
}

// The simulated device: host memory that only a DeviceAccess scope (op bodies, collectives, transfers) may address.
// The meta device (a memory plan's model): shapes and bytes without memory; writes do nothing, reads raise, nothing is
// recorded, and a user cannot pick it.
TEST(Tensor, MetaDeviceHasShapesWithoutMemory) {
  const MemoryStats before = memory_stats();
  Tensor m = Tensor::zeros({1 << 20, 1 << 20}, DType::f32, MemCategory::activations, Device::meta);  // 4 TiB
  EXPECT_EQ(m.nbytes(), int64_t{4} << 40);
  EXPECT_EQ(m.slice(0, 0, 2).numel(), 2 << 20);
  m.fill_(1.0f);
  m.copy_from(Tensor::empty({1 << 20, 1 << 20}, DType::bf16, MemCategory::other, Device::meta));
  const Tensor host = Tensor::zeros({3}, DType::f32, MemCategory::other);
  const Tensor moved = host.to_device(Device::meta);
  EXPECT_EQ(moved.device(), Device::meta);
  const MemoryStats after = memory_stats();
  EXPECT_EQ(after.total_current - before.total_current, host.nbytes());
  try {
    const DeviceAccess scope;  // not even an op body reads it
    (void)moved.data<float>();
    ADD_FAILURE() << "read a meta tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[3] f32 is on the meta device"), std::string::npos) << e.what();
  }
  Tensor back = Tensor::empty({3}, DType::f32, MemCategory::other);
  EXPECT_THROW(back.copy_from(moved), Error);
  EXPECT_THROW(parse_device("meta"), Error);
}

// Megatron-FSDP's release and reacquire: the storage's memory given back under live handles (a view and a copy of the
// handle see it alike), its accounting dropped and restored; addressing its data in between raises naming the tensor;
// taken again it is writable, and releasing twice or taking a held storage again changes nothing.
TEST(Tensor, ReleasedStorageKeepsItsHandles) {
  const MemoryStats before = memory_stats();
  Tensor t = Tensor::zeros({4, 8}, DType::f32, MemCategory::gradients);
  const Tensor view = t.slice(0, 1, 3), copy = t;
  const auto held = [&] { return memory_stats().current[static_cast<size_t>(MemCategory::gradients)]; };
  const int64_t with = held();
  EXPECT_EQ(with - before.current[static_cast<size_t>(MemCategory::gradients)], t.nbytes());
  copy.release_storage();
  copy.release_storage();
  EXPECT_FALSE(t.resident());
  EXPECT_FALSE(view.resident());
  EXPECT_EQ(held(), with - t.nbytes());
  try {
    (void)view.data<float>();
    ADD_FAILURE() << "read a released tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 8] f32 is released"), std::string::npos) << e.what();
  }
  EXPECT_THROW(t.zero_(), Error);
  view.reacquire_storage();
  t.reacquire_storage();
  EXPECT_TRUE(copy.resident());
  EXPECT_EQ(held(), with);
  t.fill_(2.0f);
  EXPECT_EQ(view.data<float>()[3], 2.0f);
  EXPECT_FALSE(Tensor().resident());
}

// A tensor born released holds and records no memory until taken; take_storage_of passes a resident storage's memory
// (and contents) to a released one of the same bytes, device and category without the allocator: the accounting and
// the count of memory taken stay as they were, the giver is left released, and mismatched storages are refused.
TEST(Tensor, TakeStorageOfPassesTheMemoryOn) {
  const auto held = [] { return memory_stats().current[static_cast<size_t>(MemCategory::parameters)]; };
  const int64_t before = held();
  const DeviceMemoryStats cpu_before = memory_device_stats(Device::cpu);
  const Tensor shell = Tensor::released({2, 8}, DType::f32, MemCategory::parameters);
  EXPECT_FALSE(shell.resident());
  EXPECT_EQ(held(), before);
  EXPECT_EQ(memory_device_stats(Device::cpu).taken, cpu_before.taken);
  Tensor from = Tensor::empty({4, 4}, DType::f32, MemCategory::parameters);
  from.fill_(3.0f);
  const int64_t taken = memory_device_stats(Device::cpu).taken;
  EXPECT_EQ(taken, cpu_before.taken + 1);
  const Tensor view = shell.slice(0, 1, 2);
  shell.take_storage_of(from);
  EXPECT_TRUE(view.resident());
  EXPECT_FALSE(from.resident());
  EXPECT_EQ(view.data<float>()[7], 3.0f);  // (the contents carried)
  EXPECT_EQ(held(), before + from.nbytes());
  EXPECT_EQ(memory_device_stats(Device::cpu).taken, taken);
  from.take_storage_of(shell);  // and back
  EXPECT_FALSE(shell.resident());
  EXPECT_EQ(from.data<float>()[15], 3.0f);
  EXPECT_THROW(shell.take_storage_of(shell), Error);  // (not resident)
  EXPECT_THROW(from.take_storage_of(from), Error);    // (not released)
  for (const Tensor& other : {Tensor::released({3, 4}, DType::f32, MemCategory::parameters),
                              Tensor::released({4, 4}, DType::f32, MemCategory::gradients)}) {
    try {
      other.take_storage_of(from);
      ADD_FAILURE() << "took a storage of another size or category";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("differ"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(from.resident());
  }
  shell.reacquire_storage();  // (from the allocator: counted)
  EXPECT_EQ(memory_device_stats(Device::cpu).taken, taken + 1);
  EXPECT_EQ(held(), before + 2 * from.nbytes());
  const Tensor meta = Tensor::released({2}, DType::f32, MemCategory::parameters, Device::meta);
  EXPECT_EQ(meta.device(), Device::meta);
}

TEST(Tensor, SimulatedDeviceRefusesHostAccessOutsideTransfers) {
  Tensor h = Tensor::empty({3, 4}, DType::f32, MemCategory::other);
  for (int i = 0; i < 12; ++i) h.data<float>()[i] = static_cast<float>(i);
  const Tensor view = h.slice(1, 1, 3);  // [3, 2], not contiguous
  const Tensor d = view.to_device(Device::sim);
  EXPECT_EQ(d.device(), Device::sim);
  EXPECT_TRUE(d.is_contiguous());
  try {
    (void)d.data<float>();
    ADD_FAILURE() << "host code read a sim tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("host code addressed the data of a sim tensor [3, 2] f32"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)d.raw(), Error);
  {
    const DeviceAccess scope;  // what an op body holds
    EXPECT_EQ(d.data<float>()[1], 2.0f);
  }
  float back[6] = {};
  d.copy_to_host(back, 6);
  EXPECT_EQ(std::vector<float>(back, back + 6), (std::vector<float>{1, 2, 5, 6, 9, 10}));
  EXPECT_THROW(d.copy_to_host(back, 5), Error);                  // the destination must hold every element
  EXPECT_THROW(d.to(DType::bf16).copy_to_host(back, 6), Error);  // read as the wrong element type
  const Tensor round = d.to_device(Device::cpu);
  EXPECT_EQ(round.device(), Device::cpu);
  EXPECT_EQ(round.data<float>()[5], 10.0f);
  EXPECT_TRUE(d.to_device(Device::sim).same_data(d));                          // already there: the tensor itself
  Tensor z = Tensor::zeros({2}, DType::f32, MemCategory::other, Device::sim);  // zero_/fill_ run on the device
  z.fill_(1.5f);
  EXPECT_EQ(z.to_device(Device::cpu).data<float>()[1], 1.5f);
  EXPECT_THROW(h.copy_from(Tensor::zeros({3, 4}, DType::bf16, MemCategory::other, Device::sim)), Error);  // dtype
  EXPECT_EQ(parse_device("sim"), Device::sim);
  EXPECT_THROW(parse_device("gpu"), Error);
}

// The one rule of device memory (core/tensor.cpp), the same on cuda and sim: inside a device, fill, zero, conversion
// and strided copies run as the device's kernels and give the CPU's bits; between devices only a contiguous
// one-dtype transfer passes; host code's own parallel loops may not address device memory. On cuda where a GPU is
// visible, on sim everywhere.
class DeviceRule : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam() == Device::cuda) SKIP_WITHOUT_GPU();
  }
};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor c = t.to_device(Device::cpu);
  const auto* b = static_cast<const uint8_t*>(c.raw());
  return {b, b + c.nbytes()};
}

TEST_P(DeviceRule, FillConvertAndStridedCopiesRunOnTheDeviceWithTheCpusBits) {
  const Device dev = GetParam();
  Tensor h = Tensor::empty({4, 6, 5}, DType::f32, MemCategory::other);
  for (int64_t i = 0; i < h.numel(); ++i)
    h.data<float>()[i] = std::ldexp(static_cast<float>(i * 37 % 101) - 50.0f, static_cast<int>(i % 30) - 20);
  const Tensor d = h.to_device(dev);
  Tensor hn = h.clone();       // a NaN and an infinity inside the view below, for the float dtypes only (a non-finite
  hn.data<float>()[8] = kNaN;  // value converted to an int is undefined behaviour)
  hn.data<float>()[38] = -kInf;
  const Tensor dn = hn.to_device(dev);
  // Strided views in every dtype, converted on the device, against the same conversion on the host.
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f8e4m3, DType::f8e5m2, DType::f64, DType::i32, DType::i64,
                  DType::boolean}) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor& hs = dtype_is_float(t) ? hn : h;
    const Tensor& ds = dtype_is_float(t) ? dn : d;
    const Tensor hv = hs.slice(1, 1, 5).select(2, 3), dv = ds.slice(1, 1, 5).select(2, 3);  // [4, 4], strides [30, 5]
    const Tensor hc = hv.to(t), dc = dv.to(t);
    EXPECT_EQ(dc.device(), dev);
    EXPECT_EQ(bytes_of(dc), bytes_of(hc));
    EXPECT_EQ(bytes_of(dc.to(DType::f32)), bytes_of(hc.to(DType::f32)));  // and back, from a device tensor
  }
  // A strided destination, converting: the device's and the host's copy give the same bytes.
  Tensor hd = Tensor::zeros({4, 6, 5}, DType::bf16, MemCategory::other);
  Tensor dd = Tensor::zeros({4, 6, 5}, DType::bf16, MemCategory::other, dev);
  Tensor hs = hd.slice(2, 1, 4), ds = dd.slice(2, 1, 4);
  hs.copy_from(h.slice(2, 0, 3));
  ds.copy_from(d.slice(2, 0, 3));
  EXPECT_EQ(bytes_of(dd), bytes_of(hd));
  Tensor dclone = d.slice(0, 1, 3).clone();
  EXPECT_TRUE(dclone.is_contiguous());
  EXPECT_EQ(bytes_of(dclone), bytes_of(h.slice(0, 1, 3).clone()));
  // fill_ and zero_ on strided views, any dtype for zero_.
  hs.fill_(-2.75f);
  ds.fill_(-2.75f);
  EXPECT_EQ(bytes_of(dd), bytes_of(hd));
  Tensor hi = Tensor::empty({3, 8}, DType::i64, MemCategory::other);
  for (int64_t i = 0; i < 24; ++i) hi.data<int64_t>()[i] = i - 5;
  Tensor di = hi.to_device(dev);
  hi.slice(1, 2, 5).zero_();
  di.slice(1, 2, 5).zero_();
  EXPECT_EQ(bytes_of(di), bytes_of(hi));
  Tensor dz = Tensor::zeros({5}, DType::f8e4m3, MemCategory::other, dev);
  dz.fill_(500.0f);  // saturates to 448, as on the host
  EXPECT_EQ(bytes_of(dz), std::vector<uint8_t>(5, 0x7e));
}

// NaNs keep their sign and payload through every float dtype as x86 converts them (the device builds them bit by
// bit, since CUDA's conversions return a canonical NaN), and floats saturate into ints (NaN gives 0) on every device.
TEST_P(DeviceRule, NaNsAndOutOfRangeValuesConvertTheSameEverywhere) {
  const Device dev = GetParam();
  Tensor h = Tensor::empty({6}, DType::f32, MemCategory::other);
  const uint32_t bits[6] = {0xffc00001u, 0x7f800001u, 0x7fc12345u, 0x80000000u, 0x60ad78ecu, 0xe0ad78ecu};
  for (int i = 0; i < 6; ++i) h.data<float>()[i] = from_bits(bits[i]);  // -qNaN, sNaN, payload, -0, +-1e20
  const Tensor d = h.to_device(dev);
  const Tensor back = d.to(DType::f64).to(DType::f32).to_device(Device::cpu);
  EXPECT_EQ(std::bit_cast<uint32_t>(back.data<float>()[0]), 0xffc00001u);
  EXPECT_EQ(std::bit_cast<uint32_t>(back.data<float>()[1]), 0x7fc00001u);  // quieted, payload kept
  EXPECT_EQ(std::bit_cast<uint32_t>(back.data<float>()[2]), 0x7fc12345u);
  EXPECT_EQ(std::bit_cast<uint32_t>(back.data<float>()[3]), 0x80000000u);
  for (DType t : {DType::f16, DType::bf16, DType::f64})
    EXPECT_EQ(bytes_of(d.to(t)), bytes_of(h.to(t))) << dtype_name(t);
  const Tensor i32 = d.to(DType::i32).to_device(Device::cpu), i64 = d.to(DType::i64).to_device(Device::cpu);
  EXPECT_EQ(std::vector<int32_t>(i32.data<int32_t>(), i32.data<int32_t>() + 6),
            (std::vector<int32_t>{0, 0, 0, 0, INT32_MAX, INT32_MIN}));
  EXPECT_EQ(std::vector<int64_t>(i64.data<int64_t>(), i64.data<int64_t>() + 6),
            (std::vector<int64_t>{0, 0, 0, 0, INT64_MAX, INT64_MIN}));
}

TEST_P(DeviceRule, BetweenDevicesOnlyContiguousOneDtypeTransfersPass) {
  const Device dev = GetParam();
  const Tensor h = Tensor::zeros({3, 4}, DType::f32, MemCategory::other);
  Tensor d = Tensor::zeros({3, 4}, DType::f32, MemCategory::other, dev);
  d.copy_from(h);  // a transfer
  Tensor dbf = Tensor::zeros({3, 4}, DType::bf16, MemCategory::other, dev);
  try {
    dbf.copy_from(h);
    ADD_FAILURE() << "a converting copy between devices passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a copy between devices is a transfer of a contiguous tensor in one dtype"),
              std::string::npos)
        << e.what();
  }
  Tensor dv = Tensor::zeros({3, 2}, DType::f32, MemCategory::other, dev);
  EXPECT_THROW(dv.copy_from(h.slice(1, 0, 2)), Error);  // a strided source across devices
  EXPECT_THROW(h.slice(1, 0, 2).copy_from(dv), Error);  // a strided destination across devices
  EXPECT_NO_THROW(h.slice(1, 0, 2).to_device(dev));     // to_device makes it contiguous first, on its own device
  EXPECT_NO_THROW(d.slice(1, 0, 2).to_device(Device::cpu));
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceRule, ::testing::Values(Device::sim, Device::cuda),
                         [](const ::testing::TestParamInfo<Device>& i) { return std::string(device_name(i.param)); });

// Host code's own OpenMP loops may not address device memory (only an op body's workers, whose thread holds the
// scope, may); outside any parallel region the scope decides as before.
TEST(DeviceRuleSim, HostParallelLoopsMayNotAddressDeviceMemory) {
  const Tensor d = Tensor::zeros({64}, DType::f32, MemCategory::other, Device::sim);
  int refused = 0, allowed = 0;
#pragma omp parallel for reduction(+ : refused) num_threads(2)
  for (int i = 0; i < 2; ++i) {
    try {
      (void)d.raw();
    } catch (const Error&) {
      ++refused;
    }
  }
  {
    const DeviceAccess scope;  // an op body: its workers may
#pragma omp parallel for reduction(+ : allowed) num_threads(2)
    for (int i = 0; i < 2; ++i) allowed += d.raw() != nullptr;
  }
  EXPECT_EQ(refused, 2);
  EXPECT_EQ(allowed, 2);
}

TEST(Tensor, CopyConvertFillZero) {
  Tensor t = iota_tensor();
  Tensor col = t.select(2, 3);  // non-contiguous destination
  Tensor src = Tensor::empty(Shape{2, 3}, DType::bf16, MemCategory::other);
  src.fill_(-1.5f);
  col.copy_from(src);
  EXPECT_EQ(values(t)[3], -1.5f);
  EXPECT_EQ(values(t)[23], -1.5f);
  EXPECT_EQ(values(t)[22], 22.0f);

  Tensor h = t.to(DType::bf16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  EXPECT_EQ(values(h), values(t));  // small integers and -1.5 are exact in bf16
  Tensor c = t.slice(0, 1, 2).clone();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(values(c)[0], 12.0f);
  c.data<float>()[0] = 7.0f;
  EXPECT_EQ(t.data<float>()[12], 12.0f);  // clone owns its storage

  t.slice(1, 0, 1).zero_();  // zeroes rows 0 of both batches only
  const auto v = values(t);
  EXPECT_EQ(v[0], 0.0f);
  EXPECT_EQ(v[3], 0.0f);
  EXPECT_EQ(v[4], 4.0f);
  EXPECT_EQ(v[12], 0.0f);
  EXPECT_EQ(v[16], 16.0f);

  Tensor z = Tensor::zeros(Shape{3}, DType::f16, MemCategory::other);
  EXPECT_EQ(values(z), (std::vector<float>{0, 0, 0}));
  EXPECT_THROW(z.copy_from(t), Error);
  Tensor ints = Tensor::empty(Shape{2}, DType::i32, MemCategory::other);
  EXPECT_THROW(ints.fill_(1.0f), Error);
}

// Philox-4x32-10 written independently from Random123's description: round = two 32x32->64 products,
// key bumped by the Weyl constants between rounds.
std::array<uint32_t, 4> philox_reference(std::array<uint32_t, 4> x, std::array<uint32_t, 2> k) {
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k[0] += 0x9E3779B9u;
      k[1] += 0xBB67AE85u;
    }
    const uint64_t a = uint64_t{0xD2511F53u} * x[0];
    const uint64_t b = uint64_t{0xCD9E8D57u} * x[2];
    x = {uint32_t(b >> 32) ^ x[1] ^ k[0], uint32_t(b), uint32_t(a >> 32) ^ x[3] ^ k[1], uint32_t(a)};
  }
  return x;
}

TEST(Rng, PhiloxKnownAnswers) {
  // Random123's kat_vectors for philox4x32 with 10 rounds.
  using A4 = std::array<uint32_t, 4>;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}), (A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}), (A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
  for (uint32_t i = 0; i < 64; ++i) {
    const A4 c{i * 2654435761u, i, ~i, i << 7};
    const std::array<uint32_t, 2> k{i * 40503u, 0xdeadbeefu ^ i};
    ASSERT_EQ(philox4x32_10(c, k), philox_reference(c, k));
  }
}

TEST(Rng, KeysDependOnSeedAndName) {
  EXPECT_EQ(philox_key(1, "w"), philox_key(1, "w"));
  EXPECT_NE(philox_key(1, "w"), philox_key(2, "w"));
  EXPECT_NE(philox_key(1, "w"), philox_key(1, "v"));
}

TEST(Rng, UniformStaysInsideTheOpenInterval) {
  // Philox word 0xffffff91 (key {0, 0}, element 43231112, found by search) used to round to exactly 1.0f.
  EXPECT_LT(philox_uniform({0, 0}, 43231112), 1.0f);
  EXPECT_GT(philox_uniform({0, 0}, 43231112), 0.99999f);
  for (uint64_t i = 0; i < 1000; ++i) {
    const float u = philox_uniform({1, 2}, i);
    ASSERT_TRUE(u > 0.0f && u < 1.0f) << i;
  }
}

TEST(Rng, FillIsLayoutIndependent) {
  Tensor full = Tensor::empty(Shape{1000}, DType::f32, MemCategory::other);
  rng_fill_normal(full, 42, "layer.0.w", 0.5f, 2.0f);
  Tensor part = Tensor::empty(Shape{300}, DType::f32, MemCategory::other);
  rng_fill_normal(part, 42, "layer.0.w", 0.5f, 2.0f, 413);  // odd start: not aligned to a Philox block
  for (int i = 0; i < 300; ++i) ASSERT_EQ(part.data<float>()[i], full.data<float>()[413 + i]) << i;
  Tensor part16 = Tensor::empty(Shape{300}, DType::bf16, MemCategory::other);
  rng_fill_normal(part16, 42, "layer.0.w", 0.5f, 2.0f, 413);
  for (int i = 0; i < 300; ++i) ASSERT_EQ(part16.data<bf16>()[i].bits, float_to_bf16(full.data<float>()[413 + i]).bits);

  Tensor u = Tensor::empty(Shape{1000}, DType::f32, MemCategory::other);
  rng_fill_uniform(u, 42, "u", -1.0f, 3.0f);
  Tensor u2 = Tensor::empty(Shape{10}, DType::f32, MemCategory::other);
  rng_fill_uniform(u2, 42, "u", -1.0f, 3.0f, 990);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(u2.data<float>()[i], u.data<float>()[990 + i]);
}

TEST(Rng, SampleMoments) {
  constexpr int n = 200000;
  Tensor t = Tensor::empty(Shape{n}, DType::f32, MemCategory::other);
  rng_fill_normal(t, 7, "moments", 1.0f, 3.0f);
  double s = 0, ss = 0;
  for (int i = 0; i < n; ++i) {
    s += t.data<float>()[i];
    ss += double(t.data<float>()[i]) * t.data<float>()[i];
  }
  const double mean = s / n, std = std::sqrt(ss / n - mean * mean);
  // Standard errors: 3 / sqrt(n) = 0.0067 for the mean, ~3 / sqrt(2n) = 0.0047 for the std; allow ~4 sigma.
  EXPECT_NEAR(mean, 1.0, 0.03);
  EXPECT_NEAR(std, 3.0, 0.02);

  rng_fill_uniform(t, 7, "uniform", -2.0f, 2.0f);
  double us = 0;
  for (int i = 0; i < n; ++i) {
    const float v = t.data<float>()[i];
    ASSERT_TRUE(v > -2.0f && v < 2.0f);
    us += v;
  }
  EXPECT_NEAR(us / n, 0.0, 0.02);  // std 2/sqrt(3), standard error 0.0026
}

TEST(Memory, CurrentAndPeakByCategory) {
  const int opt = static_cast<int>(MemCategory::optimizer_state);
  const int grads = static_cast<int>(MemCategory::gradients);
  const MemoryStats before = memory_stats();
  {
    Tensor a = Tensor::empty(Shape{1024, 256}, DType::f32, MemCategory::optimizer_state);  // 1 MiB
    Tensor b = Tensor::empty(Shape{1024, 256}, DType::bf16, MemCategory::gradients);       // 0.5 MiB
    const MemoryStats during = memory_stats();
    EXPECT_EQ(during.current[opt] - before.current[opt], 1 << 20);
    EXPECT_EQ(during.current[grads] - before.current[grads], 1 << 19);
    EXPECT_EQ(during.total_current - before.total_current, (1 << 20) + (1 << 19));
    EXPECT_GE(during.peak[opt], during.current[opt]);
    Tensor view = a.slice(0, 0, 10);  // views allocate nothing
    EXPECT_EQ(memory_stats().current[opt], during.current[opt]);
    EXPECT_EQ(view.category(), MemCategory::optimizer_state);
  }
  const MemoryStats after = memory_stats();
  EXPECT_EQ(after.current[opt], before.current[opt]);
  EXPECT_EQ(after.current[grads], before.current[grads]);

  memory_reset_peaks();
  EXPECT_EQ(memory_stats().peak[opt], after.current[opt]);
  { Tensor big = Tensor::empty(Shape{2 << 20}, DType::f32, MemCategory::optimizer_state); }  // 8 MiB
  const MemoryStats end = memory_stats();
  EXPECT_EQ(end.current[opt], after.current[opt]);
  EXPECT_EQ(end.peak[opt], after.current[opt] + (8 << 20));
  EXPECT_GE(end.total_peak, end.total_current + (8 << 20));
  EXPECT_EQ(memory_format_bytes(3 << 20), "3.0 MiB");
  EXPECT_EQ(memory_format_bytes(512), "512 B");
  EXPECT_STREQ(mem_category_name(MemCategory::optimizer_state), "optimizer_state");
}

// Per device: bytes, peak and live storages (views share their storage: no count of their own); other devices' counters
// stay as they were.
TEST(Memory, PerDeviceBytesPeakAndCount) {
  const DeviceMemoryStats before = memory_device_stats(Device::cpu), sim_before = memory_device_stats(Device::sim);
  {
    Tensor a = Tensor::empty(Shape{1024}, DType::f32, MemCategory::activations);
    Tensor b = Tensor::empty(Shape{256}, DType::bf16, MemCategory::other);
    const Tensor view = a.slice(0, 0, 10);
    const DeviceMemoryStats during = memory_device_stats(Device::cpu);
    EXPECT_EQ(during.current - before.current, 4096 + 512);
    EXPECT_EQ(during.count - before.count, 2);
    EXPECT_GE(during.peak, during.current);
  }
  const DeviceMemoryStats after = memory_device_stats(Device::cpu);
  EXPECT_EQ(after.current, before.current);
  EXPECT_EQ(after.count, before.count);
  memory_reset_peaks();
  EXPECT_EQ(memory_device_stats(Device::cpu).peak, after.current);
  const DeviceMemoryStats sim = memory_device_stats(Device::sim);
  EXPECT_EQ(sim.current, sim_before.current);
  EXPECT_EQ(sim.count, sim_before.count);
}

// core/env.h: environment variables are read as strictly as flags (issue 27, defect 7: MOECORE_COMM_TIMEOUT_S=-5 used
// to switch the collective timeout off).
struct ScopedEnv {
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() { unsetenv(name_); }
  const char* name_;
};

std::string env_number_error(const char* value) {
  ScopedEnv env("MOECORE_TEST_ENV_NUMBER", value);
  try {
    (void)env_number("MOECORE_TEST_ENV_NUMBER", 0, 6e7, "seconds; 0 waits forever");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Env, NumberInItsDomainIsRead) {
  {
    ScopedEnv env("MOECORE_TEST_ENV_NUMBER", nullptr);
    EXPECT_FALSE(env_number("MOECORE_TEST_ENV_NUMBER", 0, 10, "x").has_value());
  }
  for (const auto& [text, value] : std::vector<std::pair<const char*, double>>{
           {"0", 0.0}, {"600", 600.0}, {"0.5", 0.5}, {"1e3", 1000.0}, {"6e7", 6e7}}) {
    ScopedEnv env("MOECORE_TEST_ENV_NUMBER", text);
    EXPECT_EQ(env_number("MOECORE_TEST_ENV_NUMBER", 0, 6e7, "x"), value) << text;
  }
}

TEST(Env, NumberOutsideItsDomainOrJunkIsRefusedNamingTheVariableAndTheRange) {
  for (const char* bad : {"-5", "-0.001", "nan", "NaN", "inf", "-inf", "1e999", "6.1e7", "99999999999999999999999",
                          "abc", "5s", " 5", "5 ", "", "1,5"}) {
    const std::string msg = env_number_error(bad);
    EXPECT_NE(msg.find("MOECORE_TEST_ENV_NUMBER='" + std::string(bad) + "'"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("[0, 60000000]"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("0 waits forever"), std::string::npos) << bad << ": " << msg;
  }
}

TEST(Env, SwitchReadsBooleansAndRefusesAnythingElse) {
  for (const char* on : {"1", "true", "ON", "Yes"}) {
    ScopedEnv env("MOECORE_TEST_ENV_SWITCH", on);
    EXPECT_TRUE(env_switch("MOECORE_TEST_ENV_SWITCH", false, "x")) << on;
  }
  for (const char* off : {"0", "false", "Off", "no", ""}) {
    ScopedEnv env("MOECORE_TEST_ENV_SWITCH", off);
    EXPECT_FALSE(env_switch("MOECORE_TEST_ENV_SWITCH", true, "x")) << off;
  }
  {
    ScopedEnv env("MOECORE_TEST_ENV_SWITCH", nullptr);
    EXPECT_TRUE(env_switch("MOECORE_TEST_ENV_SWITCH", true, "x"));
    EXPECT_FALSE(env_switch("MOECORE_TEST_ENV_SWITCH", false, "x"));
  }
  for (const char* bad : {"2", "-1", "maybe", "1 ", "enable"}) {
    ScopedEnv env("MOECORE_TEST_ENV_SWITCH", bad);
    try {
      (void)env_switch("MOECORE_TEST_ENV_SWITCH", false, "does the thing");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("MOECORE_TEST_ENV_SWITCH='" + std::string(bad) + "'"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("set 1 (does the thing) or 0"), std::string::npos) << e.what();
    }
  }
}

TEST(Env, ChoiceReadsOneOfItsValuesAndRefusesAnythingElse) {
  {
    ScopedEnv env("MOECORE_TEST_ENV_CHOICE", nullptr);
    EXPECT_FALSE(env_choice("MOECORE_TEST_ENV_CHOICE", {"a", "bb", "c"}, "x").has_value());
  }
  for (const char* good : {"a", "bb", "c"}) {
    ScopedEnv env("MOECORE_TEST_ENV_CHOICE", good);
    EXPECT_EQ(env_choice("MOECORE_TEST_ENV_CHOICE", {"a", "bb", "c"}, "x"), good);
  }
  for (const char* bad : {"", "b", "A", "a ", "d"}) {
    ScopedEnv env("MOECORE_TEST_ENV_CHOICE", bad);
    try {
      (void)env_choice("MOECORE_TEST_ENV_CHOICE", {"a", "bb", "c"}, "what it picks");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("MOECORE_TEST_ENV_CHOICE='" + std::string(bad) +
                                           "' is not a, bb or c "
                                           "(what it picks)"),
                std::string::npos)
          << e.what();
    }
  }
}

// Without CUDA nothing is launched, but MOECORE_CUDA_SYNC is still checked rather than ignored.
TEST(Env, CudaSyncIsCheckedInEveryBuild) {
  ScopedEnv env("MOECORE_CUDA_SYNC", "sometimes");
  if (device_available()) GTEST_SKIP() << "read once per process: a CUDA build may have read it already";
  EXPECT_THROW((void)device_sync_each_launch(), Error);
}

}  // namespace
}  // namespace moecore
