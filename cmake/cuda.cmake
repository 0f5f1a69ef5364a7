# The one place that decides whether plait builds its CUDA/NCCL path.
# PLAIT_CUDA=OFF: never. AUTO: when nvcc and NCCL are found. ON: required, fail otherwise.
# The GPU sources (csrc/reduce/reduce_cuda.cu, csrc/transport/nccl.cc) land with the GPU issue;
# until then every configuration builds the CPU module and says so once.
set(PLAIT_WITH_CUDA OFF)
if(NOT PLAIT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(PLAIT_CUDA STREQUAL "ON" AND NOT CMAKE_CUDA_COMPILER)
    message(FATAL_ERROR "PLAIT_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()

function(plait_add_cuda target)
  if(PLAIT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PLAIT_CUDA=ON: this plait version has no GPU path yet; use AUTO or OFF")
  endif()
  message(STATUS "plait: building CPU-only (shared-memory transport); PLAIT_CUDA=${PLAIT_CUDA}")
  target_compile_definitions(${target} PRIVATE PLAIT_WITH_CUDA=0)
endfunction()
