# Optional Python extension (python/): KVSCOPE_PYTHON=AUTO builds it when Python 3's development files and
# pybind11 (Debian's pybind11-dev, or pip's pybind11 under scikit-build-core) are found. Sets
# KVSCOPE_HAVE_PYTHON. The interpreter is Debian's /usr/bin/python3 unless one is given
# (-DPython3_EXECUTABLE=...; scikit-build-core passes the interpreter pip runs): the extension is for
# that interpreter's version, which is also the version of kvscope's cached environment (scripts/setup).
set(KVSCOPE_HAVE_PYTHON OFF)
if(NOT KVSCOPE_PYTHON STREQUAL "OFF")
  if(NOT DEFINED Python3_EXECUTABLE AND DEFINED Python_EXECUTABLE)
    set(Python3_EXECUTABLE ${Python_EXECUTABLE})
  elseif(NOT DEFINED Python3_EXECUTABLE AND EXISTS /usr/bin/python3)
    set(Python3_EXECUTABLE /usr/bin/python3)
  endif()
  find_package(Python3 COMPONENTS Interpreter Development.Module)
  if(Python3_FOUND)
    find_package(pybind11 CONFIG QUIET)
  endif()
  if(Python3_FOUND AND pybind11_FOUND)
    set(KVSCOPE_HAVE_PYTHON ON)
    message(STATUS "kvscope: Python extension enabled (Python ${Python3_VERSION}, pybind11 ${pybind11_VERSION})")
  elseif(KVSCOPE_PYTHON STREQUAL "ON")
    message(FATAL_ERROR "KVSCOPE_PYTHON=ON but Python 3 development files or pybind11 were not found "
                        "(scripts/setup installs python3-dev and pybind11-dev)")
  else()
    message(STATUS "kvscope: Python 3 development files or pybind11 not found, Python extension disabled")
  endif()
endif()
