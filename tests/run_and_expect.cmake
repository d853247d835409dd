# SPDX-License-Identifier: BSD-3-Clause
cmake_policy(SET CMP0007 NEW)  # keep the empty fields of a figure check
# Runs COMMAND (its arguments separated by |) and fails unless its exit status is
# EXIT (a number, or "nonzero" for any failure), its output (stdout and
# stderr together) matches the regular expression MATCH, and - when given -
# does not match NOT_MATCH. ctest's own PASS_REGULAR_EXPRESSION ignores the
# exit status: a program that prints its summary and then crashes would pass.
# FIGURES checks numbers the output prints: checks separated by "!!", each
# "regex~min~max", the regex capturing the number in its first group, min
# or max empty for no bound (a learning example stays above chance accuracy,
# below the untrained loss).
string(REPLACE "|" ";" COMMAND "${COMMAND}")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(output "${out}${err}")
if(EXIT STREQUAL "nonzero")
  set(exit_ok NOT status EQUAL 0)
else()
  set(exit_ok status EQUAL ${EXIT})
endif()
if(NOT (${exit_ok}))
  message(FATAL_ERROR "exit status ${status}, expected ${EXIT}:\n${output}")
endif()
if(NOT output MATCHES "${MATCH}")
  message(FATAL_ERROR "output does not match '${MATCH}':\n${output}")
endif()
if(DEFINED NOT_MATCH AND output MATCHES "${NOT_MATCH}")
  message(FATAL_ERROR "output matches '${NOT_MATCH}':\n${output}")
endif()
if(DEFINED FIGURES)
  string(REPLACE "!!" ";" checks "${FIGURES}")
  foreach(check IN LISTS checks)
    string(REPLACE "~" ";" fields "${check}")
    list(GET fields 0 regex)
    list(GET fields 1 low)
    list(GET fields 2 high)
    if(NOT output MATCHES "${regex}")
      message(FATAL_ERROR "output has no figure '${regex}':\n${output}")
    endif()
    set(value "${CMAKE_MATCH_1}")
    if((NOT low STREQUAL "" AND value LESS low) OR (NOT high STREQUAL "" AND value GREATER high))
      message(FATAL_ERROR "'${regex}' is ${value}, outside [${low}, ${high}]:\n${output}")
    endif()
  endforeach()
endif()
