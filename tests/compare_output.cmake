# SPDX-License-Identifier: BSD-3-Clause
# Runs GENERATOR and fails unless its output equals the file EXPECTED.
execute_process(COMMAND ${GENERATOR} OUTPUT_VARIABLE actual RESULT_VARIABLE rc)
file(READ ${EXPECTED} expected)
if(NOT rc EQUAL 0 OR NOT actual STREQUAL expected)
  message(FATAL_ERROR "${EXPECTED} is out of date: regenerate it with ${GENERATOR} > ${EXPECTED}")
endif()
