// The device mesh: world ranks laid out on axes (pp, dp, cp, ep), ep innermost, then
// cp, so expert and context traffic stays between neighbouring ranks (one node):
//
//   rank = ((pp_i * dp + dp_i) * cp + cp_i) * ep + ep_i,   dp = world / (pp * cp * ep)
//
// Each axis, and each group of axes the sharding needs, has its own communicator;
// within a group, ranks are numbered by the same formula restricted to its axes.
//   ep, cp, dp, pp     one axis
//   dp_cp              dp x cp: the group expert parameters are sharded over
//   dp_cp_ep           dp x cp x ep: the group every other parameter is sharded over
//   pp_ep              pp x ep: the ranks that together hold one replica of the weights
#pragma once

#include <string>

#include "comm/communicator.h"

namespace mt::comm {

struct MeshShape {
  int pp = 1, dp = 1, cp = 1, ep = 1;
  int size() const { return pp * dp * cp * ep; }
};

// dp from the world size; an error naming the numbers when pp * cp * ep does not
// divide it. Needs no MPI, so `moetrain plan` can use it before any launch.
MeshShape mesh_shape(int world_size, int pp, int cp, int ep);

struct MeshCoord {
  int pp = 0, dp = 0, cp = 0, ep = 0;
};
MeshCoord mesh_coord(const MeshShape& s, int rank);

class DeviceMesh {
 public:
  // Collective over `world`: every rank builds the same mesh.
  DeviceMesh(Communicator& world, int pp, int cp, int ep);

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  std::string str() const;  // "pp 1 x dp 2 x cp 1 x ep 2 (rank 3: pp 0, dp 1, cp 0, ep 1)"

  Communicator& world() { return world_; }
  Communicator& pp() { return pp_; }
  Communicator& dp() { return dp_; }
  Communicator& cp() { return cp_; }
  Communicator& ep() { return ep_; }
  Communicator& dp_cp() { return dp_cp_; }
  Communicator& dp_cp_ep() { return dp_cp_ep_; }
  Communicator& pp_ep() { return pp_ep_; }

 private:
  MeshShape shape_;
  MeshCoord coord_;
  Communicator& world_;
  Communicator pp_, dp_, cp_, ep_, dp_cp_, dp_cp_ep_, pp_ep_;
};

}  // namespace mt::comm
