// The TCP store's wire format. Plain fixed-size fields, little-endian host order (all
// supported hosts are little-endian), a magic number and a version in the hello.
//
// Connection: client sends Hello + token bytes; server answers HelloReply + message bytes.
// The token travels in clear: it keeps out whoever can reach the port, not whoever can watch
// the network (README, Security).
// Then requests, each: QueryType (1 byte), then fields; strings are u32 length + bytes.
// Replies: Status (1 byte), then the query's result fields.
#pragma once

#include <cstdint>

namespace meshcoll::store::wire {

inline constexpr uint32_t kMagic = 0x5453434d;  // "MCST"
inline constexpr uint16_t kVersion = 2;
inline constexpr uint32_t kMaxKeyBytes = 64 * 1024;
inline constexpr uint32_t kMaxValueBytes = 64u * 1024 * 1024;
inline constexpr uint32_t kMaxTokenBytes = 1024;
// A hello reply's message (an error sentence) is at most this long: a longer length, or a
// status no server sends, means the peer is not a meshcoll store.
inline constexpr uint16_t kMaxHelloMessageBytes = 4096;
inline constexpr uint32_t kMaxWaitKeys = 1 << 16;

#pragma pack(push, 1)
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t token_len;
  uint32_t generation;  // the client's meshcoll.init of this process, from 0 (Note [Generations])
};
struct HelloReply {
  uint8_t status;  // HelloStatus
  uint16_t message_len;
};
#pragma pack(pop)

enum class HelloStatus : uint8_t { kOk = 0, kBadToken = 1, kBadVersion = 2, kStale = 3 };
inline constexpr uint8_t kLastHelloStatus = 3;

enum class QueryType : uint8_t {
  kSet = 1,         // key, value                 -> -
  kGet = 2,         // key, i64 timeout_ms        -> value
  kAdd = 3,         // key, i64 delta             -> i64
  kCompareSet = 4,  // key, expected, desired     -> value
  kWait = 5,        // u32 n, n keys, i64 timeout -> -
  kCheck = 6,       // u32 n, n keys              -> u8
  kDelete = 7,      // key                        -> u8
  kNumKeys = 8,     // -                          -> i64
};

// kBadValue: add() on a value that is not a decimal int64, or a sum that overflows.
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kError = 2, kBadValue = 3 };

}  // namespace meshcoll::store::wire
