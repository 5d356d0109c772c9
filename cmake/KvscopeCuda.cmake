# Optional CUDA: KVSCOPE_CUDA=AUTO enables it when nvcc is found.
# Sets KVSCOPE_HAVE_CUDA and provides CUDA::cudart, CUDA::cublas, CUDA::cupti
# and CUDA::nvtx3 through FindCUDAToolkit (no hard-coded paths in targets).
set(KVSCOPE_HAVE_CUDA OFF)
if(NOT KVSCOPE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # sm_80 and sm_90 machine code, plus sm_90 PTX for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90")
    endif()
    enable_language(CUDA)
    set(CMAKE_CUDA_STANDARD 17)  # CMake 3.25 does not know nvcc 13's C++20 flag
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(KVSCOPE_HAVE_CUDA ON)
    message(STATUS "kvscope: CUDA backend enabled (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(KVSCOPE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVSCOPE_CUDA=ON but no CUDA compiler was found (set CUDACXX or put nvcc on PATH)")
  else()
    message(STATUS "kvscope: nvcc not found, CUDA backend disabled")
  endif()
endif()

# NVTX3 is header-only; use the toolkit's copy when present.
set(KVSCOPE_HAVE_NVTX OFF)
if(KVSCOPE_HAVE_CUDA AND TARGET CUDA::nvtx3)
  set(KVSCOPE_HAVE_NVTX ON)
endif()
set(KVSCOPE_HAVE_CUPTI OFF)
if(KVSCOPE_HAVE_CUDA AND TARGET CUDA::cupti)
  set(KVSCOPE_HAVE_CUPTI ON)
endif()
message(STATUS "kvscope: NVTX ${KVSCOPE_HAVE_NVTX}, CUPTI ${KVSCOPE_HAVE_CUPTI}")
