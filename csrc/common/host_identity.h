// Which host (and IPC namespace) this process runs on, as ranks compare it: shared memory
// is set up only among ranks that publish the same identity (transport/shm/segment.h), the
// hierarchy groups ranks by it (python/meshcoll/hierarchy.py), and NCCL's direct kernels
// need every rank on one host.
#pragma once

#include <string>

namespace meshcoll {

// Hostname, boot id and IPC namespace; MESHCOLL_HOST_ID when set (Note [Configuration]).
std::string host_identity();

}  // namespace meshcoll
