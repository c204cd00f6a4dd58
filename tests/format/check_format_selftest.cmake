# Self-test of check_format.cmake, so a checker that passes everything cannot hide: in a scratch tree with
# the project's .clang-format, an unformatted file must fail the check (and be named), and the same code
# as clang-format writes it must pass.
# Usage: cmake -DCLANG_FORMAT=<clang-format> -DSOURCE_DIR=<project root> -DWORK_DIR=<scratch> -P this file
cmake_minimum_required(VERSION 3.25)
set(check "${CMAKE_CURRENT_LIST_DIR}/check_format.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/src")
file(COPY "${SOURCE_DIR}/.clang-format" DESTINATION "${WORK_DIR}")
file(WRITE "${WORK_DIR}/src/unformatted.cpp"
     "int  add( int a,int b ){return a+b;}\nint twice(int x){\n    return add(x,x);}\n")
execute_process(COMMAND "${CLANG_FORMAT}" src/unformatted.cpp WORKING_DIRECTORY "${WORK_DIR}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE formatted)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "format self-test: ${CLANG_FORMAT} could not format a scratch file")
endif()
file(WRITE "${WORK_DIR}/src/formatted.cpp" "${formatted}")

macro(run_check expect_fail)
  execute_process(COMMAND "${CMAKE_COMMAND}" -DCLANG_FORMAT=${CLANG_FORMAT} -DSOURCE_DIR=${WORK_DIR} -P "${check}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "check_format.cmake on ${WORK_DIR} (exit ${rc}):\n${out}${err}")
  if(${expect_fail} AND rc EQUAL 0)
    message(FATAL_ERROR "format self-test: the check passed a tree with an unformatted file")
  elseif(NOT ${expect_fail} AND NOT rc EQUAL 0)
    message(FATAL_ERROR "format self-test: the check failed a tree whose files clang-format wrote")
  endif()
endmacro()

run_check(TRUE)
if(NOT err MATCHES "src/unformatted\\.cpp" OR err MATCHES "src/formatted\\.cpp")
  message(FATAL_ERROR "format self-test: the failure must name src/unformatted.cpp and only it")
endif()
file(REMOVE "${WORK_DIR}/src/unformatted.cpp")
run_check(FALSE)
file(REMOVE_RECURSE "${WORK_DIR}")
message(STATUS "format self-test: unformatted file rejected and named, formatted file accepted")
