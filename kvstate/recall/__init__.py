"""Recall: does a model still retrieve exactly what its context holds? Tasks (MQAR, phonebook,
needle) with seedable generators and exact scoring; training and the engine-driven phonebook test
build on them."""
