# Self-test of check_device_seam.cmake, so a check that passes everything cannot hide: a scratch tree whose MoE
# source reads tensor data must fail (and be named); the same tree with the loop behind an op must pass.
# Usage: cmake -DWORK_DIR=<scratch> -P this file
cmake_minimum_required(VERSION 3.25)
set(check "${CMAKE_CURRENT_LIST_DIR}/check_device_seam.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/src/moecore/moe" "${WORK_DIR}/src/moecore/nn")
file(WRITE "${WORK_DIR}/src/moecore/nn/layer.cpp" "void layer(Tensor& y, const Tensor& x) { ops::add(y, y, x, {}); }\n")

macro(run_check expect_fail)
  execute_process(COMMAND "${CMAKE_COMMAND}" -DSOURCE_DIR=${WORK_DIR} -P "${check}" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "check_device_seam.cmake on ${WORK_DIR} (exit ${rc}):\n${out}${err}")
  if(${expect_fail} AND (rc EQUAL 0 OR NOT err MATCHES "moe/bad.cpp:2"))
    message(FATAL_ERROR "device seam self-test: the check passed (or did not name) a source that reads tensor data")
  elseif(NOT ${expect_fail} AND NOT rc EQUAL 0)
    message(FATAL_ERROR "device seam self-test: the check failed a tree that computes only through ops")
  endif()
endmacro()

file(WRITE "${WORK_DIR}/src/moecore/moe/bad.cpp"
     "void scale(Tensor& t) {\n  float* p = t.data<float>();\n  p[0] *= 2;\n}\n")
run_check(TRUE)
file(WRITE "${WORK_DIR}/src/moecore/moe/bad.cpp" "void scale(Tensor& t) { ops::scale(t, 2.0f, {}); }\n")
run_check(FALSE)
