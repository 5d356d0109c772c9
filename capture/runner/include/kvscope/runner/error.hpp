// Errors of the reference model runner: one typed exception naming the file, tensor or parameter.
#pragma once

#include <stdexcept>
#include <string>

namespace kvscope::runner {

enum class ErrorKind {
  kModel,  // model directory: config.json, weights, vocabulary (missing, mismatched, unsupported)
  kInput,  // user input: question, image, scene, device request
  kCuda,   // CUDA runtime / cuBLAS failure or CUDA requested without a GPU
};

class RunnerError : public std::runtime_error {
 public:
  RunnerError(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace kvscope::runner
