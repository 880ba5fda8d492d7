"""What quality means: task generators and loaders, scorers, the microscope, evaluation engines."""
