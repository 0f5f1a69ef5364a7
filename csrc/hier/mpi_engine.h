// The MPI engine between hosts (engine.h over MPI's C API), for numpy users under mpirun. Built
// into its own module, plait._mpi, only when CMake finds MPI, so plait._C never links libmpi.
#ifndef PLAIT_HIER_MPI_ENGINE_H
#define PLAIT_HIER_MPI_ENGINE_H
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // MPI's C API only, not the removed C++ bindings
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <stddef.h>

#include "hier/engine.h"

namespace plait {

// An engine group over the members of comm: duplicates it twice (data, and the job-wide flag's
// messages), so it is collective over comm, like MPI_Comm_dup. Returns nullptr and a message in
// err when MPI cannot serve it (not initialised, thread level below MPI_THREAD_MULTIPLE).
// chunk_bytes: the largest piece one MPI call moves (MPI counts are int); 0: the default.
plait_engine* mpi_engine_create(MPI_Comm comm, const char* label, size_t chunk_bytes, char* err,
                                size_t errlen);

}  // namespace plait
#endif
