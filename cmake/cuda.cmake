# The one place that decides whether plait builds its CUDA/NCCL path.
# PLAIT_CUDA=OFF: never. AUTO (default): when nvcc is found. ON: required, fail otherwise.
#
# NCCL is not needed to build: plait loads libnccl.so.2 with dlopen at first use (the path comes
# from Python, which finds the nvidia-nccl-cu13 wheel) and declares the few NCCL entry points it
# calls in csrc/cuda/nccl_abi.h. When a real nccl.h is found (NCCL_HOME, the build's Python's
# nvidia.nccl wheel, or a system include dir) one extra file checks those declarations against it.
# The CUDA runtime is linked statically (cudart_static), so `import plait` needs no driver.
set(PLAIT_WITH_CUDA OFF)
if(PLAIT_CUDA STREQUAL "OFF")
  message(STATUS "plait: building CPU-only (PLAIT_CUDA=OFF)")
else()
  # nvcc 13 dropped everything below sm_75; 90 is the H200 the GPU checks target. Set before
  # check_language so the probe compiles for an architecture this nvcc accepts.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures plait compiles for")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(PLAIT_WITH_CUDA ON)
  elseif(PLAIT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PLAIT_CUDA=ON but no CUDA compiler (nvcc) was found: put nvcc on PATH "
                        "or set CMAKE_CUDA_COMPILER, or build with PLAIT_CUDA=AUTO/OFF")
  else()
    message(STATUS "plait: building CPU-only (PLAIT_CUDA=AUTO and no nvcc found)")
  endif()
endif()

if(PLAIT_WITH_CUDA)
  set(_plait_nccl_hints "")
  if(DEFINED ENV{NCCL_HOME})
    list(APPEND _plait_nccl_hints "$ENV{NCCL_HOME}/include")
  endif()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'include'))"
    OUTPUT_VARIABLE _plait_wheel_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_plait_wheel_inc)
    list(APPEND _plait_nccl_hints "${_plait_wheel_inc}")
  endif()
  find_path(PLAIT_NCCL_INCLUDE_DIR nccl.h HINTS ${_plait_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS})
  if(PLAIT_NCCL_INCLUDE_DIR AND EXISTS "${PLAIT_NCCL_INCLUDE_DIR}/nccl.h")
    set(_plait_abi "checked against ${PLAIT_NCCL_INCLUDE_DIR}/nccl.h")
  else()
    set(_plait_abi "no nccl.h found, declarations not checked")
  endif()
  message(STATUS "plait: building with CUDA ${CUDAToolkit_VERSION} (sm ${CMAKE_CUDA_ARCHITECTURES}); "
                 "NCCL loaded at run time (${_plait_abi})")
endif()

function(plait_add_cuda target)
  if(NOT PLAIT_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE PLAIT_WITH_CUDA=0)
    return()
  endif()
  target_compile_definitions(${target} PRIVATE PLAIT_WITH_CUDA=1)
  target_sources(${target} PRIVATE
    csrc/reduce/reduce_cuda.cu
    csrc/cuda/nccl_loader.cc
    csrc/cuda/stream_queue.cc
    csrc/transport/nccl.cc
    csrc/transport/cuda_ipc.cu
    csrc/transport/cuda_ipc.cc
    csrc/algo/ipc_one_shot.cc
    csrc/algo/ipc_two_shot.cc
    csrc/algo/ipc_ring.cc
    csrc/algo/gpu_ctx.cc
    csrc/algo/gpu_nccl.cc
    csrc/algo/gpu_ring.cc
    csrc/algo/gpu_tree.cc)
  if(PLAIT_NCCL_INCLUDE_DIR AND EXISTS "${PLAIT_NCCL_INCLUDE_DIR}/nccl.h")
    target_sources(${target} PRIVATE csrc/cuda/nccl_abi_check.cc)
    set_source_files_properties(csrc/cuda/nccl_abi_check.cc PROPERTIES
                                INCLUDE_DIRECTORIES "${PLAIT_NCCL_INCLUDE_DIR}")
  endif()
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  target_link_libraries(${target} PRIVATE CUDA::cudart_static ${CMAKE_DL_LIBS})
endfunction()
