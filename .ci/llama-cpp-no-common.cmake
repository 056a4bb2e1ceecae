# Included by llama.cpp's CMakeLists right after its project() (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# .ci/run's llama-cpp-python build): llama-cpp-python forces LLAMA_BUILD_COMMON on in the cache, but its
# Python package loads only libllama and libggml*, never libllama-common (~40% of the build's compile
# time). A normal variable of that name hides the cached option in llama.cpp's directory (CMP0077), so
# common, and what needs it, is not configured.
set(LLAMA_BUILD_COMMON OFF)
