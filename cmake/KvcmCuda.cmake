# Resolves KVCM_ENABLE_CUDA (AUTO/ON/OFF) into KVCM_CUDA_ENABLED.
# AUTO turns CUDA on when nvcc is on PATH or under /usr/local/cuda; the kernels then compile
# for sm_80 and sm_90 whether or not this machine has a GPU.
set(KVCM_CUDA_ENABLED OFF)
if(NOT KVCM_ENABLE_CUDA STREQUAL "OFF")
  find_program(KVCM_NVCC nvcc HINTS /usr/local/cuda/bin)
  if(KVCM_NVCC)
    set(CMAKE_CUDA_COMPILER ${KVCM_NVCC})
    set(KVCM_CUDA_ENABLED ON)
  elseif(KVCM_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVCM_ENABLE_CUDA=ON but nvcc was not found")
  endif()
endif()

if(KVCM_CUDA_ENABLED)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 80 90)
  endif()
  enable_language(CUDA)
  # CMake 3.25 does not know nvcc 13's C++20 dialect flag ("requires the language dialect
  # CUDA20"), so .cu files build as C++17; host .cc files stay C++20.
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  find_package(CUDAToolkit REQUIRED)
  find_library(KVCM_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_ROOT}/lib /usr/local/cuda/lib)
endif()
message(STATUS "kvcm: CUDA kernels ${KVCM_CUDA_ENABLED} (KVCM_ENABLE_CUDA=${KVCM_ENABLE_CUDA})")
if(KVCM_CUDA_ENABLED AND KVCM_NCCL_LIBRARY)
  message(STATUS "kvcm: NCCL transport ON (${KVCM_NCCL_LIBRARY})")
else()
  message(STATUS "kvcm: NCCL transport OFF (kvcm-agent --transport=nccl refuses to start)")
endif()
