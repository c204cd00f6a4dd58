# Self-test of check_citations.cmake, so a check that passes everything cannot hide: a scratch tree citing a document
# outside the repository, or a docs/ file that does not exist, must fail (and be named); the tree citing only its own
# docs/ must pass.
# Usage: cmake -DWORK_DIR=<scratch> -P this file
cmake_minimum_required(VERSION 3.25)
set(check "${CMAKE_CURRENT_LIST_DIR}/check_citations.cmake")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/src/moecore/io" "${WORK_DIR}/docs")
file(WRITE "${WORK_DIR}/docs/formats.md" "# Formats\n")
file(WRITE "${WORK_DIR}/src/moecore/io/good.h" "// Layout: docs/formats.md §3; data in ../shared/data.\n")

macro(run_check expect_fail expect_name)
  execute_process(COMMAND "${CMAKE_COMMAND}" -DSOURCE_DIR=${WORK_DIR} -P "${check}" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "check_citations.cmake on ${WORK_DIR} (exit ${rc}):\n${out}${err}")
  if(${expect_fail} AND (rc EQUAL 0 OR NOT err MATCHES "${expect_name}"))
    message(FATAL_ERROR "citation self-test: the check passed (or did not name ${expect_name}) a bad citation")
  elseif(NOT ${expect_fail} AND NOT rc EQUAL 0)
    message(FATAL_ERROR "citation self-test: the check failed a tree that cites only its own docs/")
  endif()
endmacro()

# The bad citations are spelled in pieces so that this file does not make them itself.
set(outside "../shared")
set(missing "docs/format")
file(WRITE "${WORK_DIR}/src/moecore/io/bad.h" "// Layout: ${outside}/docs/formats.md §3.\n")
run_check(TRUE "io/bad.h")
file(WRITE "${WORK_DIR}/src/moecore/io/bad.h" "// Layout (§3): ${missing}.md.\n")
run_check(TRUE "${missing}.md")
file(WRITE "${WORK_DIR}/src/moecore/io/bad.h" "// Layout: docs/formats.md §3.\n")
run_check(FALSE "")
