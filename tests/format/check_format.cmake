# Formatting check: runs `clang-format --dry-run -Werror` over every C++ source and header of the tree and
# fails naming the files that differ from .clang-format. It only reads; to fix, run the printed command.
# Usage: cmake -DCLANG_FORMAT=<clang-format> -DSOURCE_DIR=<tree root> -P check_format.cmake
# Files: git's tracked and untracked-but-not-ignored *.cpp *.h *.cu *.cuh when SOURCE_DIR is a git work-tree
# root; otherwise (a source tarball, git missing) every such file below SOURCE_DIR outside build*/ and .*/.
cmake_minimum_required(VERSION 3.25)
if(NOT CLANG_FORMAT OR NOT EXISTS "${CLANG_FORMAT}")
  message(FATAL_ERROR "format check: clang-format not found (CLANG_FORMAT='${CLANG_FORMAT}'); install Debian's "
                      "clang-format (bash scripts/install-deps.sh) and re-run cmake")
endif()
if(NOT IS_DIRECTORY "${SOURCE_DIR}" OR NOT EXISTS "${SOURCE_DIR}/.clang-format")
  message(FATAL_ERROR "format check: SOURCE_DIR='${SOURCE_DIR}' is not a tree with a .clang-format")
endif()
file(REAL_PATH "${SOURCE_DIR}" root)

set(files "")
set(listing "")
find_program(GIT git)
if(GIT)
  execute_process(COMMAND "${GIT}" -C "${root}" rev-parse --show-toplevel RESULT_VARIABLE rc
                  OUTPUT_VARIABLE top OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(rc EQUAL 0)
    file(REAL_PATH "${top}" top)
  endif()
  if(rc EQUAL 0 AND top STREQUAL root)
    execute_process(COMMAND "${GIT}" -C "${root}" ls-files --cached --others --exclude-standard --
                            "*.cpp" "*.h" "*.cu" "*.cuh"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "format check: git ls-files failed in ${root}: ${err}")
    endif()
    string(REGEX REPLACE "\n$" "" out "${out}")
    if(out)
      string(REPLACE "\n" ";" files "${out}")
    endif()
    list(REMOVE_DUPLICATES files)
    set(listing "git ls-files")
  endif()
endif()
if(NOT listing)
  file(GLOB_RECURSE files RELATIVE "${root}" "${root}/*.cpp" "${root}/*.h" "${root}/*.cu" "${root}/*.cuh")
  list(FILTER files EXCLUDE REGEX "^(build[^/]*|\\.[^/]*)/")
  set(listing "a directory scan (not a git work tree)")
endif()

execute_process(COMMAND "${CLANG_FORMAT}" --version OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE)
set(present "")
foreach(f IN LISTS files)
  if(EXISTS "${root}/${f}")  # a tracked file deleted in the work tree is skipped
    list(APPEND present "${f}")
  endif()
endforeach()
list(LENGTH present checked)
if(checked EQUAL 0)
  message(FATAL_ERROR "format check: no C++ files found in ${root} (listed by ${listing})")
endif()
# One clang-format process for all files (one per file costs ~0.1 s each); with -Werror and --ferror-limit=1
# it reports the first difference of every unformatted file as "FILE:LINE:COL: error: ...".
execute_process(COMMAND "${CLANG_FORMAT}" --dry-run -Werror --ferror-limit=1 ${present}
                WORKING_DIRECTORY "${root}" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
set(bad "")
set(report "")
if(NOT rc EQUAL 0)
  string(REGEX MATCHALL "(^|\n)[^\n]*:[0-9]+:[0-9]+: error: [^\n]*" diagnostics "${err}")
  foreach(d IN LISTS diagnostics)
    string(STRIP "${d}" d)
    string(REGEX REPLACE "^(.*):[0-9]+:[0-9]+: error: .*$" "\\1" f "${d}")
    if(f IN_LIST present AND NOT f IN_LIST bad)
      list(APPEND bad "${f}")
      string(APPEND report "  ${f}\n      ${d}\n")
    endif()
  endforeach()
  if(NOT bad)  # failed without naming a file: a bad .clang-format, a crash
    message(FATAL_ERROR "format check: ${CLANG_FORMAT} failed (exit ${rc}):\n${err}")
  endif()
endif()
list(LENGTH bad nbad)
if(nbad GREATER 0)
  list(JOIN bad " " bad_args)
  message(FATAL_ERROR "format check: ${nbad} of ${checked} files are not formatted as .clang-format says "
                      "(${version}; files from ${listing}):\n${report}"
                      "Fix with:\n  cd ${root} && ${CLANG_FORMAT} -i ${bad_args}\n")
endif()
message(STATUS "format check: all ${checked} files formatted (${version}; files from ${listing})")
