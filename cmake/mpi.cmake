# The one place that decides whether plait builds its MPI engine, the optional module plait._mpi
# (plait._C never links libmpi: numpy users without MPI are unaffected).
# PLAIT_MPI=OFF: never. AUTO (default): when FindMPI finds MPI's C API. ON: required.
# Without it the multi-host communicator drives mpi4py from Python (or uses gloo).
set(PLAIT_WITH_MPI OFF)
if(PLAIT_MPI STREQUAL "OFF")
  message(STATUS "plait: no MPI engine (PLAIT_MPI=OFF)")
else()
  set(MPI_CXX_SKIP_MPICXX ON)  # MPI's C API only, not the removed C++ bindings
  find_package(MPI COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(PLAIT_WITH_MPI ON)
    message(STATUS "plait: MPI engine plait._mpi over ${MPI_CXX_LIBRARIES}")
  elseif(PLAIT_MPI STREQUAL "ON")
    message(FATAL_ERROR "PLAIT_MPI=ON but CMake found no MPI: install one (apt-get install "
                        "libopenmpi-dev) or put its mpicc on PATH, or build with PLAIT_MPI=AUTO/OFF")
  else()
    message(STATUS "plait: no MPI engine (PLAIT_MPI=AUTO and no MPI found)")
  endif()
endif()

if(PLAIT_WITH_MPI)
  pybind11_add_module(_mpi MODULE csrc/hier/mpi_engine.cc csrc/hier/mpi_group.cc csrc/bindings/mpi.cc)
  target_include_directories(_mpi PRIVATE csrc)
  target_compile_options(_mpi PRIVATE -Wall -Wextra -Wno-unused-parameter)
  target_link_libraries(_mpi PRIVATE MPI::MPI_CXX)
  install(TARGETS _mpi DESTINATION plait)
endif()
