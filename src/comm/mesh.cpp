#include "comm/mesh.h"

#include <array>
#include <initializer_list>

#include "core/check.h"

namespace mt::comm {

namespace {

enum Axis { kPp, kDp, kCp, kEp };

// The group of `axes` that `rank` belongs to: color numbers the group (the other
// axes' coordinates), key numbers the rank inside it (its coordinates on `axes`),
// both mixed-radix in (pp, dp, cp, ep) order.
Communicator split_group(Communicator& world, const MeshShape& s, const MeshCoord& c, std::initializer_list<Axis> axes,
                         const char* name) {
  const std::array<int, 4> size = {s.pp, s.dp, s.cp, s.ep};
  const std::array<int, 4> at = {c.pp, c.dp, c.cp, c.ep};
  std::array<bool, 4> in{};
  for (Axis a : axes) in[a] = true;
  int color = 0, key = 0;
  for (int a = 0; a < 4; ++a) {
    if (in[a])
      key = key * size[a] + at[a];
    else
      color = color * size[a] + at[a];
  }
  return world.split(color, key, name);
}

}  // namespace

MeshShape mesh_shape(int world_size, int pp, int cp, int ep) {
  MT_CHECK(pp >= 1 && cp >= 1 && ep >= 1) << "parallelism degrees must be >= 1, got pp " << pp << ", cp " << cp
                                          << ", ep " << ep;
  MT_CHECK(world_size >= 1) << "the world should have at least one rank, got " << world_size;
  // In 64 bits, and no larger than the world: pp * cp * ep of large degrees overflows int.
  const int64_t model_ranks = int64_t{pp} * cp * ep;
  MT_CHECK(model_ranks <= world_size && world_size % model_ranks == 0)
      << "the world of " << world_size << " ranks does not divide into pp " << pp << " x cp " << cp << " x ep " << ep
      << " = " << model_ranks << " (dp = world / (pp * cp * ep) must be a whole number)";
  return MeshShape{pp, world_size / static_cast<int>(model_ranks), cp, ep};
}

MeshCoord mesh_coord(const MeshShape& s, int rank) {
  MT_CHECK(rank >= 0 && rank < s.size()) << "rank " << rank << " is outside the mesh of " << s.size();
  return MeshCoord{.pp = rank / (s.dp * s.cp * s.ep),
                   .dp = rank / (s.cp * s.ep) % s.dp,
                   .cp = rank / s.ep % s.cp,
                   .ep = rank % s.ep};
}

DeviceMesh::DeviceMesh(Communicator& world, int pp, int cp, int ep)
    : shape_(mesh_shape(world.size(), pp, cp, ep)),
      coord_(mesh_coord(shape_, world.rank())),
      world_(world),
      pp_(split_group(world, shape_, coord_, {kPp}, "pp")),
      dp_(split_group(world, shape_, coord_, {kDp}, "dp")),
      cp_(split_group(world, shape_, coord_, {kCp}, "cp")),
      ep_(split_group(world, shape_, coord_, {kEp}, "ep")),
      dp_cp_(split_group(world, shape_, coord_, {kDp, kCp}, "dp x cp")),
      dp_cp_ep_(split_group(world, shape_, coord_, {kDp, kCp, kEp}, "dp x cp x ep")),
      pp_ep_(split_group(world, shape_, coord_, {kPp, kEp}, "pp x ep")) {}

std::string DeviceMesh::str() const {
  return "pp " + std::to_string(shape_.pp) + " x dp " + std::to_string(shape_.dp) + " x cp " +
         std::to_string(shape_.cp) + " x ep " + std::to_string(shape_.ep) + " (rank " + std::to_string(world_.rank()) +
         ": pp " + std::to_string(coord_.pp) + ", dp " + std::to_string(coord_.dp) + ", cp " +
         std::to_string(coord_.cp) + ", ep " + std::to_string(coord_.ep) + ")";
}

}  // namespace mt::comm
