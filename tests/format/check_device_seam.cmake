# The device seam as a static check (issue 11): the MoE layer (src/moecore/moe) and the layers (src/moecore/nn)
# compute only through ops (kernels/ops.h), so their sources may not address tensor data (data<T>(), raw()) or
# start OpenMP loops. model/ prepares the host batch on the host, so it is held to the seam by the simulated-device
# runs of the test suite instead (tests with the _sim suffix), which fail on any host access to device data.
# Usage: cmake -DSOURCE_DIR=<project root> -P this file
cmake_minimum_required(VERSION 3.25)
file(GLOB files "${SOURCE_DIR}/src/moecore/moe/*.cpp" "${SOURCE_DIR}/src/moecore/moe/*.h"
     "${SOURCE_DIR}/src/moecore/nn/*.cpp" "${SOURCE_DIR}/src/moecore/nn/*.h")
if(NOT files)
  message(FATAL_ERROR "device seam check: no sources under ${SOURCE_DIR}/src/moecore/{moe,nn}")
endif()
set(found "")
foreach(f IN LISTS files)
  file(STRINGS "${f}" lines)
  set(n 0)
  foreach(line IN LISTS lines)
    math(EXPR n "${n} + 1")
    if(line MATCHES "data<[A-Za-z0-9_:]+>\\(|\\.raw\\(\\)|->raw\\(\\)|#pragma omp")
      file(RELATIVE_PATH rel "${SOURCE_DIR}" "${f}")
      string(APPEND found "  ${rel}:${n}: ${line}\n")
    endif()
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "device seam check: these lines address tensor data outside the ops (move the loop into a "
                      "kernel behind kernels/ops.h):\n${found}")
endif()
list(LENGTH files count)
message(STATUS "device seam check: ${count} files under moe/ and nn/ address no tensor data")
