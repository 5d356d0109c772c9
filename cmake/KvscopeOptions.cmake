# Warning and sanitizer flags, applied per target through kvscope_set_warnings().
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_CXX_EXTENSIONS OFF)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)

# CPU kernels are built for the machine that builds them (CI and users build from
# source on the machine that runs the code). Turn off for portable binaries.
option(KVSCOPE_NATIVE_ARCH "Compile C++ with -march=native (AVX2/AVX-512 where present)" ON)
if(KVSCOPE_NATIVE_ARCH)
  add_compile_options($<$<COMPILE_LANGUAGE:CXX>:-march=native>)
endif()

# libFuzzer build (tests/fuzz, docs/robustness.md): clang only; every library is instrumented for
# coverage and built with the sanitizers, the fuzz target links libFuzzer's main.
option(KVSCOPE_FUZZ "Build the libFuzzer target fuzz_readers (clang; implies KVSCOPE_SANITIZE)" OFF)
if(KVSCOPE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KVSCOPE_FUZZ needs clang (configure with -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang)")
  endif()
  set(KVSCOPE_SANITIZE ON)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=fuzzer-no-link>)
endif()

if(KVSCOPE_SANITIZE)
  add_compile_options($<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=address,undefined>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-omit-frame-pointer>
                      $<$<COMPILE_LANGUAGE:C,CXX>:-fno-sanitize-recover=undefined>)
  add_link_options(-fsanitize=address,undefined)
endif()

function(kvscope_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVSCOPE_WERROR}>>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${KVSCOPE_WERROR}>>:-Werror=all-warnings>)
endfunction()
