// Invariant checks that print both values (GLOO_ENFORCE_EQ style).
#pragma once

#include "common/error.h"

#define MC_THROW(ExcType, ...) throw ::meshcoll::ExcType(::meshcoll::str_cat(__VA_ARGS__))

#define MC_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond))                                                                   \
      throw ::meshcoll::Error(::meshcoll::str_cat("internal check failed: " #cond \
                                                  " (", __FILE__, ":", __LINE__,   \
                                                  ") ", ##__VA_ARGS__));           \
  } while (0)

#define MC_CHECK_EQ(a, b, ...)                                                     \
  do {                                                                             \
    auto mc_a_ = (a);                                                              \
    auto mc_b_ = (b);                                                              \
    if (!(mc_a_ == mc_b_))                                                         \
      throw ::meshcoll::Error(::meshcoll::str_cat(                                 \
          "internal check failed: " #a " == " #b " (", mc_a_, " vs ", mc_b_, ") at ", \
          __FILE__, ":", __LINE__, " ", ##__VA_ARGS__));                           \
  } while (0)

#define MC_ARG_CHECK(cond, ...)                                                    \
  do {                                                                             \
    if (!(cond)) throw ::meshcoll::InvalidArgument(::meshcoll::str_cat(__VA_ARGS__)); \
  } while (0)
